//! HTTP GET for admin endpoints (`/metrics`, `/livez`, `/readyz`), on reqwest, and a raw
//! client that stalls mid-body (for a server's body bounds and timeouts).

use std::net::SocketAddr;
use std::sync::OnceLock;

use crate::prom::Metrics;

fn client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        reqwest::Client::builder()
            .no_proxy() // loopback only: an HTTP_PROXY in the environment must not matter
            .timeout(crate::PATIENCE)
            .build()
            .expect("a reqwest client")
    })
}

/// GETs `path` from `addr`; returns the status code and the body. Panics if the server does
/// not answer within [`crate::PATIENCE`].
pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    get_url(&format!("http://{addr}{path}")).await
}

/// GETs `url`; returns the status code and the body.
pub async fn get_url(url: &str) -> (u16, String) {
    let resp = client()
        .get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = resp.status().as_u16();
    let body = resp
        .text()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: reading the body: {e}"));
    (status, body)
}

/// GETs `/metrics` from `addr` (which must answer 200) and parses it.
pub async fn metrics(addr: SocketAddr) -> Metrics {
    metrics_url(&format!("http://{addr}/metrics")).await
}

/// GETs a `/metrics` URL (which must answer 200) and parses it.
pub async fn metrics_url(url: &str) -> Metrics {
    let (status, body) = get_url(url).await;
    assert_eq!(status, 200, "GET {url}: {body}");
    Metrics::parse(&body).unwrap_or_else(|e| panic!("GET {url}: not Prometheus text: {e}\n{body}"))
}

/// A raw HTTP/1.1 client that POSTs a completion declaring a `declared`-byte body, sends
/// `sent` bytes of it and stalls (the connection is returned open). It names a request id, so
/// a server that requires one still gets as far as reading the body.
pub async fn stalled_post(addr: SocketAddr, declared: usize, sent: usize) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt as _;
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    c.write_all(
        format!(
            "POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
             x-request-id: stalled\r\ncontent-length: {declared}\r\n\r\n{}",
            " ".repeat(sent)
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    c
}
