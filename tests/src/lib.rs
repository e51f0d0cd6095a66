//! A sandbox that runs the real BalanceRoute binaries as separate processes on 127.0.0.1, for
//! the end-to-end tests in `tests/tests/`.
//!
//! The binaries are built once per test run (`cargo build --bins` of the service packages, into
//! the same target directory the tests run from) and started on port 0 with `--ready-file`: each
//! binds its own ports and writes them to that file, so no port is guessed (picking a free port
//! and releasing it for the child races with every other test binding one). Tests then wait on
//! the admin `/readyz` (or `/livez`). A process is killed when its handle drops, so a failing
//! test leaves no process behind.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test harness: a panic is the report

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub mod engine;
mod freeze;
pub mod gateway;
pub mod otlp;
pub mod pki;
pub mod reflection;
pub mod replicated;
mod worker;

pub use worker::FakeWorker;

/// A process's resident set (VmRSS in /proc/<pid>/status), in bytes: what the memory-bound
/// tests measure.
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("reading /proc/{pid}/status: {e}"));
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/<pid>/status");
    kib << 10
}

/// How soon after a load has gone a process must be back within 2x of its idle RSS (the
/// allocator's background purge returns pages about a second after their last use).
pub const GIVEN_BACK_WITHIN: Duration = Duration::from_secs(30);

/// Waits for `pid`'s RSS to come back within 2x of `idle` (bytes, measured before the load)
/// within [`GIVEN_BACK_WITHIN`]; panics naming `what` and the `loaded` RSS if it does not.
/// Returns the RSS it came back to.
pub async fn memory_given_back(pid: u32, idle: u64, loaded: u64, what: &str) -> u64 {
    br_testkit::eventually(
        GIVEN_BACK_WITHIN,
        &format!(
            "{what}: RSS back within 2x of its idle {} MiB (under the load {} MiB)",
            idle >> 20,
            loaded >> 20
        ),
        || async { rss_bytes(pid) <= 2 * idle },
    )
    .await;
    rss_bytes(pid)
}

/// The workspace root.
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace root")
}

/// The directory the test binary runs from (`target/<profile>`), where `cargo build` puts bins.
fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test>  ->  target/<profile>
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf()
}

/// How long a binary that should refuse to start may run before `run_to_exit` fails.
pub const REFUSE_WITHIN: Duration = Duration::from_secs(30);

/// Runs the service binary `bin` until it exits by itself (it is expected to refuse to start);
/// its status and stderr. Fails loudly if it is still running after `REFUSE_WITHIN`.
pub fn run_to_exit<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(
    bin: &str,
    args: &[S],
) -> (ExitStatus, String) {
    let mut child = Command::new(binaries().join(bin))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {bin}: {e}"));
    let deadline = Instant::now() + REFUSE_WITHIN;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the child") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!(
                "{bin} {args:?} still running after {REFUSE_WITHIN:?}; it should have refused to start"
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("piped stderr"), &mut stderr)
        .expect("reading stderr");
    (status, stderr)
}

/// Builds the service binaries once (same profile as the tests), returns their directory.
pub fn binaries() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = bin_dir();
        let profile_release = dir.file_name().is_some_and(|n| n == "release");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(root()).args([
            "build",
            "--bins",
            "-p",
            "br-snapshot",
            "-p",
            "br-ingest",
            "-p",
            "br-decision",
            "-p",
            "br-shim",
            "-p",
            "br-emu",
            "-p",
            "brctl",
            "-p",
            "br-all",
        ]);
        // Cargo sets these for the test process; an inner build that inherits them differs
        // from the outer `cargo test` to build scripts that watch them (ring reruns on
        // CARGO_MANIFEST_DIR), so every run rebuilt ring, rustls, tonic and every service.
        for (key, _) in std::env::vars_os() {
            let k = key.to_string_lossy();
            let set_for_tests = matches!(
                k.as_ref(),
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
            ) || k.starts_with("CARGO_PKG_");
            if set_for_tests {
                cmd.env_remove(&key);
            }
        }
        if profile_release {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("cargo runs");
        assert!(status.success(), "building the service binaries failed");
        dir
    })
}

/// How long [`Split::start`] waits for each process to answer on its admin port: a hang guard
/// for a loaded 2-core machine, not a timing assertion.
const SPLIT_START_WAIT: Duration = Duration::from_secs(60);

/// The split control plane as three real processes: br-snapshot first (the other two dial
/// it), then br-ingest and br-decision on it.
pub struct Split {
    pub snapshot: Service,
    pub ingest: Service,
    pub decision: Service,
}

impl Split {
    /// Starts the three, with `snapshot_flags` for br-snapshot and `--snapshot-addr` then
    /// `decision_flags` for br-decision (`--groups`, `--policy` …). Returns once snapshot and
    /// decision are live and ingest is ready (its Apply stream to snapshot is open); decision
    /// is ready only once it can place, which needs workers.
    pub async fn start(snapshot_flags: &[&str], decision_flags: &[&str]) -> Split {
        let snapshot = Service::start("br-snapshot", snapshot_flags);
        snapshot.wait_for("/livez", SPLIT_START_WAIT).await;
        let snap = snapshot.grpc_url();
        let ingest = Service::start("br-ingest", &["--snapshot-addr", &snap]);
        let mut args = vec!["--snapshot-addr", snap.as_str()];
        args.extend_from_slice(decision_flags);
        let decision = Service::start("br-decision", &args);
        ingest.wait_for("/readyz", SPLIT_START_WAIT).await;
        decision.wait_for("/livez", SPLIT_START_WAIT).await;
        Split {
            snapshot,
            ingest,
            decision,
        }
    }
}

/// How long a process may take to bind its ports and write its ready file.
const BIND_WAIT: Duration = Duration::from_secs(30);

/// A running service process, killed on drop.
pub struct Service {
    pub name: &'static str,
    /// The ports the process bound (read from its ready file). `grpc_port` is the `--listen`
    /// port: gRPC, or the HTTP proxy for br-shim.
    pub grpc_port: u16,
    pub admin_port: u16,
    /// A gRPC service's second, HTTP/JSON port (br-decision's `--http-listen`), when it has one.
    pub http_port: Option<u16>,
    child: Option<Child>,
    /// The caller's flags (the harness adds the ports and the ready file).
    args: Vec<String>,
    /// `ulimit -n` for the process, when the test sets one.
    descriptor_limit: Option<u32>,
    /// Environment variables the test sets for the process (after the harness's own, so they
    /// win: `RUST_LOG`, `OTEL_BSP_SCHEDULE_DELAY`).
    env: Vec<(String, String)>,
    /// Holds the ready file; removed with the handle.
    dir: tempfile::TempDir,
}

impl Service {
    /// Starts `bin` on port 0 (`--listen`, `--admin-listen`) with `extra` arguments, and waits
    /// until it has written the ports it bound to its `--ready-file`.
    pub fn start(bin: &'static str, extra: &[&str]) -> Service {
        Service::launch(bin, extra, None, &[])
    }

    /// [`Service::start`] with environment variables set for the process.
    pub fn start_with_env(bin: &'static str, extra: &[&str], env: &[(&str, &str)]) -> Service {
        Service::launch(bin, extra, None, env)
    }

    /// [`Service::start`] with the process's descriptor limit set to `nofile` (`ulimit -n`,
    /// through `sh`, before the binary starts: it reads the limit at start).
    pub fn start_with_descriptor_limit(bin: &'static str, extra: &[&str], nofile: u32) -> Service {
        Service::launch(bin, extra, Some(nofile), &[])
    }

    fn launch(
        bin: &'static str,
        extra: &[&str],
        descriptor_limit: Option<u32>,
        env: &[(&str, &str)],
    ) -> Service {
        let mut s = Service {
            name: bin,
            grpc_port: 0,
            admin_port: 0,
            http_port: None,
            child: None,
            args: extra.iter().map(|s| (*s).to_owned()).collect(),
            descriptor_limit,
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            dir: tempfile::tempdir().expect("a temporary directory"),
        };
        s.spawn(0, 0);
        s
    }

    /// Starts the process on the given ports (0: any) and reads the ports it bound.
    fn spawn(&mut self, grpc_port: u16, admin_port: u16) {
        let ready = self.ready_file();
        // A previous run's file must not be mistaken for this one's.
        match std::fs::remove_file(&ready) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("removing {}: {e}", ready.display()),
        }
        let path = binaries().join(self.name);
        let log = std::env::var_os("BR_E2E_LOGS").is_some();
        let mut cmd = match self.descriptor_limit {
            None => Command::new(&path),
            Some(n) => {
                // `exec` keeps the pid: kill and /proc reach the service, not the shell
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
                    .arg(&path);
                c
            }
        };
        let child = cmd
            .arg("--listen")
            .arg(format!("127.0.0.1:{grpc_port}"))
            .arg("--admin-listen")
            .arg(format!("127.0.0.1:{admin_port}"))
            .arg("--ready-file")
            .arg(&ready)
            .args(&self.args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(if log { Stdio::inherit() } else { Stdio::null() })
            .stderr(if log { Stdio::inherit() } else { Stdio::null() })
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", path.display()));
        // Held by `self` before waiting: if the wait panics, the drop kills the process.
        let child = self.child.insert(child);
        let (grpc, admin, http) = wait_for_ready_file(self.name, child, &ready);
        self.grpc_port = grpc.port();
        self.admin_port = admin.port();
        self.http_port = http.map(|a| a.port());
    }

    /// The process id while it runs (to inspect its sockets in /proc).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn grpc_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.grpc_port))
    }

    pub fn admin_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.admin_port))
    }

    pub fn grpc_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.grpc_port)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.admin_port)
    }

    /// Kills the process (SIGKILL: a crash, not a graceful stop).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Freezes the process for `pause` (SIGSTOP, then SIGCONT from a thread): a GC pause or a
    /// throttled pod. Returns once the process has stopped; it is killed as usual if the handle
    /// drops meanwhile, and a process that took its pid since is not resumed (see
    /// `freeze::freeze_child`).
    pub fn freeze_for(&self, pause: Duration) {
        let Some(child) = self.child.as_ref() else {
            return;
        };
        let (thaw, at_thaw) = std::sync::mpsc::channel::<()>();
        freeze::freeze_child(child, at_thaw);
        std::thread::spawn(move || {
            // the length of the fault, not a wait for something to happen
            std::thread::sleep(pause);
            let _ = thaw.send(());
        });
    }

    /// Sends SIGTERM and waits for the process to exit; returns its exit status if it exited
    /// by itself within `grace` (None: it was not running, or had to be killed).
    pub fn terminate(&mut self, grace: Duration) -> Option<ExitStatus> {
        let mut c = self.child.take()?;
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = c.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
        None
    }

    /// An optional listener's address from the ready file (`key`, e.g. br-decision's
    /// `"ext_proc"` for `--ext-proc-listen`); panics if the file has no such key.
    pub fn ready_addr(&self, key: &str) -> SocketAddr {
        let path = self.ready_file();
        let bytes =
            std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let v: serde_json::Value = serde_json::from_slice(&bytes).expect("a JSON ready file");
        v[key]
            .as_str()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("{}'s ready file has no {key:?} address: {v}", self.name))
    }

    /// The `--ready-file` the process wrote its addresses to.
    pub fn ready_file(&self) -> PathBuf {
        self.dir.path().join("ready.json")
    }

    /// Starts the same binary again with the same arguments on the ports it had (a restart:
    /// its clients hold those addresses, so they are bound again, not picked anew).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn(self.grpc_port, self.admin_port);
    }

    /// Starts a killed process again on the ports it had, once they are free (a crashed pod
    /// coming back: its clients hold those addresses). Returns when its ready file is written;
    /// panics if the ports stay taken for [`BIND_WAIT`] (another process got them meanwhile).
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "{} is still running", self.name);
        let ports = [self.grpc_port, self.admin_port];
        let deadline = Instant::now() + BIND_WAIT;
        while !ports
            .iter()
            .all(|&p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        {
            assert!(
                Instant::now() < deadline,
                "{}'s ports {ports:?} still taken after {BIND_WAIT:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        self.spawn(self.grpc_port, self.admin_port);
    }

    /// Polls an admin path until it answers 200, or panics after `within`.
    pub async fn wait_for(&self, path: &str, within: Duration) {
        let url = self.admin_url(path);
        let deadline = Instant::now() + within;
        let client = reqwest::Client::new();
        loop {
            if let Ok(r) = client
                .get(&url)
                .timeout(Duration::from_millis(500))
                .send()
                .await
                && r.status().is_success()
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not answer 200 on {path} within {within:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The admin `/metrics` text.
    pub async fn metrics(&self) -> String {
        reqwest::get(self.admin_url("/metrics"))
            .await
            .expect("metrics reachable")
            .text()
            .await
            .expect("metrics text")
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits until `child` has written its ready file (`{"grpc": ADDR, "admin": ADDR}`, `"http"`
/// instead of `"grpc"` for br-shim, `"http"` beside `"grpc"` for br-decision's HTTP/JSON port;
/// written atomically by the binary once its ports are bound) and returns the `--listen` and
/// admin addresses, and the HTTP/JSON one of a gRPC service that has it. Fails
/// loudly if the process exits first or the file does not appear within [`BIND_WAIT`].
fn wait_for_ready_file(
    name: &str,
    child: &mut Child,
    path: &Path,
) -> (SocketAddr, SocketAddr, Option<SocketAddr>) {
    let deadline = Instant::now() + BIND_WAIT;
    loop {
        if let Some(status) = child.try_wait().expect("child status") {
            panic!(
                "{name} exited ({status}) before writing {}; rerun with BR_E2E_LOGS=1 for its log",
                path.display()
            );
        }
        match std::fs::read(path) {
            Ok(bytes) => {
                let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                    panic!("{name}'s ready file {} is not JSON: {e}", path.display())
                });
                let addr = |key: &str| -> SocketAddr {
                    v[key]
                        .as_str()
                        .and_then(|a| a.parse().ok())
                        .unwrap_or_else(|| {
                            panic!("{name}'s ready file has no {key:?} address: {v}")
                        })
                };
                if v.get("grpc").is_some() {
                    let http = v.get("http").is_some().then(|| addr("http"));
                    return (addr("grpc"), addr("admin"), http);
                }
                return (addr("http"), addr("admin"), None);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("reading {}: {e}", path.display()),
        }
        if Instant::now() >= deadline {
            panic!(
                "{name} did not write {} within {BIND_WAIT:?}",
                path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
