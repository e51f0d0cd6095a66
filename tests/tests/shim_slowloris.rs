//! br-shim's proxy port against slowloris: a raw TCP client that opens a connection, sends
//! the start of a request's headers (so the first-byte timeout is passed) and never finishes
//! them. With `--header-read-timeout` the shim closes the connection; without it (as
//! `axum::serve` served the port) the connection was held forever. The wait for the close is
//! bounded by a hang guard far above the timeout, not a timing assertion. A client that keeps
//! trickling bytes is closed too, and a well-behaved request on another connection is still
//! answered meanwhile.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use br_e2e::Service;
use br_testkit::within;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// A hang guard (the close is expected after the 1 s header timeout), not a timing.
const GUARD: Duration = Duration::from_secs(60);

fn shim() -> Service {
    // No ingest and no engine: the port's HTTP handling is what is tested. The first-byte
    // timeout is left far above the header timeout so only the latter can close.
    Service::start(
        "br-shim",
        &[
            "--upstream",
            "http://127.0.0.1:9",
            "--ingest-addr",
            "",
            "--engine-probe-interval",
            "0s",
            "--header-read-timeout",
            "1s",
            "--first-byte-timeout",
            "10m",
        ],
    )
}

/// Reads until the server closes the connection (EOF or reset); what it sent before.
async fn until_closed(conn: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// A request on a fresh connection gets an HTTP answer (the port still serves).
async fn answered(addr: SocketAddr) -> String {
    let mut c = TcpStream::connect(addr).await.unwrap();
    c.write_all(b"GET /health HTTP/1.1\r\nHost: shim\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let got = within(
        GUARD,
        "an answer to a complete request",
        until_closed(&mut c),
    )
    .await;
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_that_never_finish_are_cut_off() {
    let shim = shim();
    let addr = shim.grpc_addr();

    // Half a request line and one header, then silence.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    silent
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: shim\r\n")
        .await
        .unwrap();
    // A peer trickling a byte of a never-ending header now and then, as slowloris does.
    let mut trickle = TcpStream::connect(addr).await.unwrap();
    trickle
        .write_all(b"GET /v1/models HTTP/1.1\r\nX-Slow: ")
        .await
        .unwrap();
    let trickling = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        loop {
            tick.tick().await;
            if trickle.write_all(b"a").await.is_err() {
                // the server closed it: what it sent before, if anything
                return until_closed(&mut trickle).await;
            }
        }
    });

    // Meanwhile the port answers others.
    let other = answered(addr).await;
    assert!(other.starts_with("HTTP/1.1 "), "{other:?}");

    let got = within(
        GUARD,
        "the silent connection is closed",
        until_closed(&mut silent),
    )
    .await;
    // hyper closes without an answer, or with a 408; never a proxied response
    let text = String::from_utf8_lossy(&got);
    assert!(
        got.is_empty() || text.starts_with("HTTP/1.1 408"),
        "{text:?}"
    );
    let got = within(GUARD, "the trickling connection is closed", trickling)
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&got);
    assert!(
        got.is_empty() || text.starts_with("HTTP/1.1 408"),
        "{text:?}"
    );
    // and still serves
    let again = answered(addr).await;
    assert!(again.starts_with("HTTP/1.1 "), "{again:?}");
}
