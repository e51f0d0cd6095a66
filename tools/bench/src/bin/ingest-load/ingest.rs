//! Talking to the ingest under load outside its gRPC API: a free port for a started child,
//! and the progress-event counter read from its `/metrics` (plain or over mutual TLS).
//!
//! Separate because it is a hand-written HTTP/1.1 GET, apart from the load's logic.

use super::*;

pub(super) async fn free_addr() -> std::io::Result<SocketAddr> {
    tokio::net::TcpListener::bind("127.0.0.1:0")
        .await?
        .local_addr()
}

/// A one-shot HTTP/1.1 GET; over mutual TLS (verifying the server as role ingest) with `tls`.
pub(super) async fn http_get(
    addr: SocketAddr,
    path: &str,
    tls: Option<&Arc<br_trust::TlsMaterial>>,
) -> std::io::Result<(u16, String)> {
    let s = tokio::net::TcpStream::connect(addr).await?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut buf = String::new();
    match tls {
        None => {
            let mut s = s;
            s.write_all(req.as_bytes()).await?;
            s.read_to_string(&mut buf).await?;
        }
        Some(m) => {
            // The admin port speaks HTTP/1.1 (ALPN); the shared client config offers h2.
            let mut config = (*m.client_config(Some(br_trust::Role::Ingest))).clone();
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            let config = Arc::new(config);
            let name = tokio_rustls::rustls::pki_types::ServerName::from(addr.ip());
            let mut s = tokio_rustls::TlsConnector::from(config)
                .connect(name, s)
                .await?;
            s.write_all(req.as_bytes()).await?;
            // A peer closing without close_notify is an error for rustls; keep what arrived.
            let mut bytes = Vec::new();
            let mut chunk = [0u8; 16 * 1024];
            loop {
                match s.read(&mut chunk).await {
                    Ok(0) => break,
                    Ok(n) => bytes.extend_from_slice(&chunk[..n]),
                    Err(_) if !bytes.is_empty() => break,
                    Err(e) => return Err(e),
                }
            }
            buf = String::from_utf8_lossy(&bytes).into_owned();
        }
    }
    let (head, body) = buf.split_once("\r\n\r\n").unwrap_or((&buf, ""));
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, body.to_owned()))
}

pub(super) async fn ingest_events(
    admin: SocketAddr,
    tls: Option<&Arc<br_trust::TlsMaterial>>,
) -> anyhow::Result<f64> {
    let (_, body) = http_get(admin, "/metrics", tls).await?;
    body.lines()
        .find_map(|l| {
            l.strip_prefix("balanceroute_ingest_progress_events_total ")
                .and_then(|v| v.trim().parse().ok())
        })
        .context("no balanceroute_ingest_progress_events_total")
}
