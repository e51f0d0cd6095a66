//! `br-emu engine` as a real process for the end-to-end tests: started on OS-chosen ports
//! (read from its `--ready-file`), killed with SIGKILL, restarted on the same ports (its shims
//! hold those addresses), frozen with SIGSTOP until the test thaws it.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::binaries;

/// How long the engine may take to bind its ports.
const BIND_WAIT: Duration = Duration::from_secs(30);

/// A running `br-emu engine`, killed on drop.
pub struct EmuEngine {
    /// Rank g's own port.
    pub ranks: Vec<SocketAddr>,
    /// The port serving every rank (`X-data-parallel-rank`, `routed_dp_rank`).
    pub dp: SocketAddr,
    child: Option<Child>,
    args: Vec<String>,
    dir: tempfile::TempDir,
}

impl EmuEngine {
    /// Starts `br-emu engine --base-port 0 <extra>` and waits for its ports.
    pub fn start(extra: &[&str]) -> EmuEngine {
        let mut e = EmuEngine {
            ranks: Vec::new(),
            dp: SocketAddr::from(([127, 0, 0, 1], 0)),
            child: None,
            args: extra.iter().map(|s| (*s).to_owned()).collect(),
            dir: tempfile::tempdir().expect("a temporary directory"),
        };
        e.spawn(&["--base-port".into(), "0".into()]);
        e
    }

    fn spawn(&mut self, ports: &[String]) {
        let ready = self.dir.path().join("engine.json");
        let _ = std::fs::remove_file(&ready);
        let log = std::env::var_os("BR_E2E_LOGS").is_some();
        let path = binaries().join("br-emu");
        let child = Command::new(&path)
            .arg("engine")
            .args(ports)
            .arg("--ready-file")
            .arg(&ready)
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(if log { Stdio::inherit() } else { Stdio::null() })
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", path.display()));
        let child = self.child.insert(child);
        let deadline = Instant::now() + BIND_WAIT;
        let v: serde_json::Value = loop {
            if let Some(status) = child.try_wait().expect("child status") {
                panic!("br-emu engine exited ({status}) before writing its ready file");
            }
            if let Ok(bytes) = std::fs::read(&ready) {
                break serde_json::from_slice(&bytes).expect("the engine's ready file is JSON");
            }
            assert!(
                Instant::now() < deadline,
                "br-emu engine did not write its ready file within {BIND_WAIT:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        let addr = |v: &serde_json::Value| -> SocketAddr {
            v.as_str().and_then(|a| a.parse().ok()).expect("an address")
        };
        self.ranks = v["ranks"]
            .as_array()
            .expect("ranks")
            .iter()
            .map(addr)
            .collect();
        self.dp = addr(&v["dp"]);
    }

    /// Rank g's own URL.
    pub fn rank_url(&self, g: usize) -> String {
        format!("http://{}", self.ranks[g])
    }

    /// The URL of the port serving every rank.
    pub fn dp_url(&self) -> String {
        format!("http://{}", self.dp)
    }

    /// SIGKILL: the engine dies with its requests.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the ports it had (one rank only: `--base-port` and `--dp-port` name
    /// them; OS-chosen ports of several ranks are not consecutive).
    pub fn restart(&mut self) {
        assert_eq!(
            self.ranks.len(),
            1,
            "restart keeps the ports of one rank only"
        );
        self.kill();
        let ports = [
            "--base-port".to_owned(),
            self.ranks[0].port().to_string(),
            "--dp-port".to_owned(),
            self.dp.port().to_string(),
        ];
        self.spawn(&ports);
    }

    /// SIGSTOP, returning once the engine has stopped; SIGCONT when the returned sender sends or
    /// is dropped.
    pub fn freeze(&self) -> std::sync::mpsc::Sender<()> {
        let child = self.child.as_ref().expect("the engine runs");
        let (thaw, at_thaw) = std::sync::mpsc::channel::<()>();
        crate::freeze::freeze_child(child, at_thaw);
        thaw
    }

    /// The engine's per-rank request counters (`GET /stats`'s `requests_per_rank`).
    pub async fn requests_per_rank(&self) -> Vec<u64> {
        let v: serde_json::Value = reqwest::get(format!("{}/stats", self.dp_url()))
            .await
            .expect("engine /stats")
            .json()
            .await
            .expect("engine /stats JSON");
        v["requests_per_rank"]
            .as_array()
            .expect("requests_per_rank")
            .iter()
            .map(|n| n.as_u64().expect("a count"))
            .collect()
    }
}

impl Drop for EmuEngine {
    fn drop(&mut self) {
        self.kill();
    }
}
