//! What the br-all tests share: br-all started in-process as a library.

use tokio_util::sync::CancellationToken;

/// Starts br-all on loopback port 0 (gRPC and admin) for `group`, with a 1 s drain and the
/// flags in `more`; cancel the token to stop it.
pub async fn start(group: &str, more: &[&str]) -> (br_all::Running, CancellationToken) {
    let mut argv = vec![
        "br-all",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--groups",
        group,
        "--shutdown-grace",
        "1s",
    ];
    argv.extend_from_slice(more);
    let args: br_all::Args = br_runtime::config::parse_from(argv).expect("br-all's flags");
    let stop = CancellationToken::new();
    let running = br_all::start(&args, stop.clone())
        .await
        .expect("br-all starts");
    (running, stop)
}
