//! Each service binary as its `main` runs it (br-runtime's `skeleton::main`): it binds port 0
//! and reports the ports in `--ready-file`, exits 0 after a drain on SIGTERM, exits 1 naming
//! the flag when it cannot bind, and 2 on an invalid flag.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use br_e2e::{Service, run_to_exit};

const WAIT: Duration = Duration::from_secs(30);

/// Nothing listens there: the services start without their upstreams.
const NOWHERE: &str = "http://127.0.0.1:1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_binary_reports_its_ports_and_exits_0_on_sigterm() {
    let cases: [(&'static str, &str, Vec<&str>); 4] = [
        ("br-snapshot", "grpc", vec![]),
        ("br-ingest", "grpc", vec!["--snapshot-addr", NOWHERE]),
        ("br-decision", "grpc", vec!["--snapshot-addr", NOWHERE]),
        (
            "br-shim",
            "http",
            vec!["--upstream", NOWHERE, "--ingest-addr", ""],
        ),
    ];
    for (bin, key, args) in cases {
        let mut s = Service::start(bin, &args);
        let file: serde_json::Value =
            serde_json::from_slice(&std::fs::read(s.ready_file()).unwrap()).unwrap();
        let keys: Vec<&str> = file
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let mut want = vec![key, "admin"];
        want.sort_unstable();
        let mut got = keys.clone();
        got.sort_unstable();
        assert_eq!(got, want, "{bin}: {file}");
        assert_ne!(s.grpc_port, 0, "{bin}");
        assert_ne!(s.admin_port, 0, "{bin}");
        // The reported admin port is the one serving.
        s.wait_for("/livez", WAIT).await;
        let status = s.terminate(WAIT);
        assert!(
            status.is_some_and(|st| st.code() == Some(0)),
            "{bin} exits with 0 on SIGTERM: {status:?}"
        );
    }
}

#[test]
fn a_port_in_use_exits_1_naming_the_flag() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (status, stderr) = run_to_exit(
        "br-snapshot",
        &["--listen", &addr, "--admin-listen", "127.0.0.1:0"],
    );
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("binding --listen {addr}")),
        "{stderr}"
    );
}

#[test]
fn an_invalid_flag_exits_2_naming_the_limit() {
    let (status, stderr) = run_to_exit(
        "br-shim",
        &[
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--worker-id",
            "1024",
        ],
    );
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--worker-id 1024") && stderr.contains("1023"),
        "{stderr}"
    );
}

/// A configuration only the service can judge (here a plaintext admin port beyond loopback,
/// refused unless `--allow-insecure-remote`) is still a bad configuration: exit 2, like a flag
/// clap refuses, not 1 (a port in use, an unreachable upstream).
#[test]
fn a_configuration_refused_at_start_exits_2_naming_the_flag() {
    let (status, stderr) = run_to_exit(
        "br-snapshot",
        &["--listen", "127.0.0.1:0", "--admin-listen", "0.0.0.0:0"],
    );
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--admin-listen"), "{stderr}");
}

/// Each binary logs one start-up line at INFO, naming its ports, and nothing else that
/// announces a listener: the services' own "br-snapshot started" (and the like, and the shim's
/// "br-shim serving") used to come with the skeleton's generic "br-snapshot listening" and the
/// servers' "gRPC server listening" / "admin HTTP server listening", three or four start-up
/// lines for one process. Read from the binary's stderr at INFO, through a SIGTERM stop.
#[test]
fn every_binary_logs_one_start_up_line() {
    let cases: [(&str, &str, &str, Vec<&str>); 5] = [
        ("br-all", "br-all started", "grpc=", vec!["--groups", "g"]),
        ("br-snapshot", "br-snapshot started", "grpc=", vec![]),
        (
            "br-ingest",
            "br-ingest started",
            "grpc=",
            vec!["--snapshot-addr", NOWHERE],
        ),
        (
            "br-decision",
            "br-decision started",
            "grpc=",
            vec!["--snapshot-addr", NOWHERE, "--groups", "g"],
        ),
        (
            "br-shim",
            "br-shim serving",
            "listen=",
            vec!["--upstream", NOWHERE, "--ingest-addr", ""],
        ),
    ];
    for (bin, line, port, args) in cases {
        let seen = start_and_stop_at_info(bin, line, &args);
        let started: Vec<&String> = seen.iter().filter(|l| l.contains(line)).collect();
        assert_eq!(started.len(), 1, "{bin}: one start-up line: {seen:#?}");
        assert!(
            started[0].contains(&format!("{port}127.0.0.1:"))
                && started[0].contains("admin=127.0.0.1:"),
            "{bin}: it names the ports: {}",
            started[0]
        );
        let announcing: Vec<&String> = seen
            .iter()
            .filter(|l| {
                !l.contains(line)
                    && [" listening", " started", " serving"]
                        .iter()
                        .any(|w| l.contains(w))
            })
            .collect();
        assert!(
            announcing.is_empty(),
            "{bin}: no second start-up line: {announcing:#?}"
        );
        assert!(
            seen.iter().any(|l| l.contains(&format!("{bin} stopped"))),
            "{bin}: the stop is logged: {seen:#?}"
        );
    }
}

/// Runs `bin` on loopback port 0 at RUST_LOG=info until it logs `line`, stops it with SIGTERM
/// and returns every line it wrote to stderr; asserts it exited 0 (a drain, even when the
/// signal comes right after the start-up line).
fn start_and_stop_at_info(bin: &str, line: &str, args: &[&str]) -> Vec<String> {
    use std::io::BufRead as _;
    use std::process::{Command, Stdio};
    use std::sync::mpsc;

    let mut child = Command::new(br_e2e::binaries().join(bin))
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args(["--shutdown-grace", "1s"])
        .args(args)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {bin}: {e}"));
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            if tx.send(line.expect("reading stderr")).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let mut read_until = |stop: &dyn Fn(&str) -> bool, child: &mut std::process::Child| loop {
        match lines.recv_timeout(WAIT) {
            Ok(line) => {
                let done = stop(&line);
                seen.push(line);
                if done {
                    return;
                }
            }
            // stderr closed: the process has ended
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                panic!("{bin} logged nothing for {WAIT:?}: {seen:#?}");
            }
        }
    };
    read_until(&|l| l.contains(line), &mut child);
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    // every line to the end (a second start-up line, if logged, came before the stop)
    read_until(&|_| false, &mut child);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{bin}: {seen:#?}");
    seen
}

/// Every service runs on jemalloc with br-memory's settings, as it reads them back at start
/// (its debug line): a `main` without the allocator would log "allocator: not jemalloc", one
/// whose settings did not reach jemalloc its defaults (no background thread, 10 s decay).
#[test]
fn every_service_runs_on_jemalloc_with_its_settings() {
    use std::io::BufRead;
    const WANT: &str =
        "allocator: jemalloc background_thread=true dirty_decay_ms=1000 muzzy_decay_ms=0";
    let cases: [(&str, &[&str]); 5] = [
        ("br-snapshot", &[]),
        ("br-ingest", &["--snapshot-addr", NOWHERE]),
        ("br-decision", &["--snapshot-addr", NOWHERE]),
        ("br-shim", &["--upstream", NOWHERE, "--ingest-addr", ""]),
        ("br-all", &[]),
    ];
    for (bin, args) in cases {
        let mut child = std::process::Command::new(br_e2e::binaries().join(bin))
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "br_runtime::skeleton=debug")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {bin}: {e}"));
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let line = std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
                .find(|l| l.contains("allocator:"));
            let _ = tx.send(line);
        });
        let line = rx.recv_timeout(WAIT);
        let _ = child.kill();
        let _ = child.wait();
        let line = line
            .unwrap_or_else(|_| panic!("{bin} logged no allocator line within {WAIT:?}"))
            .unwrap_or_else(|| panic!("{bin} ended without an allocator line"));
        assert!(line.contains(WANT), "{bin}: {line}");
    }
}
