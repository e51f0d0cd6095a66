//! The real snapshot service, started in-process as its binary would start it (for tests of
//! the crates that talk to it: the client's watcher, decision's upstream, the snapshot's own
//! measurements).

use tokio_util::sync::CancellationToken;

/// Starts br-snapshot with gRPC on `listen` (`127.0.0.1:0` for any port; a fixed one to start
/// it again where it was), admin on a free loopback port, and the flags in `more`; cancel the
/// token to stop it.
pub async fn start(listen: &str, more: &[&str]) -> (br_snapshot::Running, CancellationToken) {
    let mut argv = vec![
        "br-snapshot",
        "--listen",
        listen,
        "--admin-listen",
        "127.0.0.1:0",
    ];
    argv.extend_from_slice(more);
    let args: br_snapshot::Args =
        br_runtime::config::parse_from(argv).expect("br-snapshot's flags");
    let stop = CancellationToken::new();
    let running = br_snapshot::start(&args, stop.clone())
        .await
        .expect("br-snapshot starts");
    (running, stop)
}

/// Where a started snapshot service answers gRPC.
pub fn url(running: &br_snapshot::Running) -> String {
    format!("http://{}", running.grpc_addr())
}
