//! Test support for the crates whose tests talk to a real snapshot service (feature
//! `test-util`, a dev-dependency only): br-snapshot started in-process as its binary would
//! start it. Offered here, by the service itself, so that the shared test kit does not depend
//! on a service.
#![allow(clippy::expect_used)] // a test that cannot start the service has nothing to test

use tokio_util::sync::CancellationToken;

use crate::{Args, Running};

/// Starts br-snapshot with gRPC on `listen` (`127.0.0.1:0` for any port; a fixed one to start
/// it again where it was), admin on a free loopback port, and the flags in `more`; cancel the
/// token to stop it.
pub async fn start(listen: &str, more: &[&str]) -> (Running, CancellationToken) {
    let mut argv = vec![
        "br-snapshot",
        "--listen",
        listen,
        "--admin-listen",
        "127.0.0.1:0",
    ];
    argv.extend_from_slice(more);
    let args: Args = br_runtime::config::parse_from(argv).expect("br-snapshot's flags");
    let stop = CancellationToken::new();
    let running = crate::start(&args, stop.clone())
        .await
        .expect("br-snapshot starts");
    (running, stop)
}

/// Where a started snapshot service answers gRPC.
pub fn url(running: &Running) -> String {
    format!("http://{}", running.grpc_addr())
}
