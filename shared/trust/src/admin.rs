//! The admin HTTP port over TLS: kubelet probes get `/livez` and `/readyz` without a client
//! certificate (kubelet's HTTPS probes present none); every other route (`/metrics`, anything
//! that reveals σ) needs a verified certificate with the `admin` role. Prometheus scrapes with
//! the admin certificate (`tls_config: {cert_file, key_file, ca_file}`).
//!
//! [`AdminListener`] is an `axum::serve::Listener` over [`crate::tls::incoming`]; each
//! connection's address carries the peer's identity ([`Peer`]), which [`require_admin`] reads.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{ConnectInfo, Request};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::ReceiverStream;

use crate::accept::{self, AcceptLimits, Held};
use crate::identity::{Identity, IdentityReader, Role};
use crate::tls::{self, TlsMaterial};

/// Paths anyone who reaches the port may read (probes).
pub const OPEN_PATHS: [&str; 2] = ["/livez", "/readyz"];

/// Who is on the other end of an admin connection.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    /// The verified certificate's identity; `None` without a certificate (a probe) or with one
    /// that carries no identity of our trust domain.
    pub identity: Option<Identity>,
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, AdminListener>>
    for Peer
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, AdminListener>) -> Self {
        stream.remote_addr().clone()
    }
}

/// TLS connections (client certificate optional) for an axum server.
pub struct AdminListener {
    local: SocketAddr,
    reader: IdentityReader,
    connections: ReceiverStream<io::Result<TlsStream<Held<TcpStream>>>>,
}

impl std::fmt::Debug for AdminListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminListener")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl AdminListener {
    pub fn new(
        listener: TcpListener,
        material: &Arc<TlsMaterial>,
        handshake_timeout: Duration,
    ) -> io::Result<AdminListener> {
        let local = listener.local_addr()?;
        let config = material.server_config_optional_client(&[b"http/1.1"]);
        Ok(AdminListener {
            local,
            reader: material.reader().clone(),
            connections: tls::incoming(
                accept::accept(listener, AcceptLimits::default(), None),
                config,
                handshake_timeout,
                None,
            ),
        })
    }
}

impl axum::serve::Listener for AdminListener {
    type Io = TlsStream<Held<TcpStream>>;
    type Addr = Peer;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.connections.next().await {
                Some(Ok(stream)) => {
                    let (tcp, session) = stream.get_ref();
                    let addr = tcp
                        .peer_addr()
                        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
                    let identity = session
                        .peer_certificates()
                        .and_then(|c| c.first())
                        .and_then(|c| self.reader.read_cert_der(c.as_ref()).ok());
                    return (stream, Peer { addr, identity });
                }
                Some(Err(_)) => continue,
                // the acceptor stopped (never, while the listener lives): park until shutdown
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(Peer {
            addr: self.local,
            identity: None,
        })
    }
}

/// axum middleware (`axum::middleware::from_fn(require_admin)`): the probe paths are open,
/// everything else needs the admin role (403 naming what was presented otherwise).
pub async fn require_admin(
    ConnectInfo(peer): ConnectInfo<Peer>,
    req: Request,
    next: Next,
) -> Response {
    if OPEN_PATHS.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    match &peer.identity {
        Some(id) if id.role == Role::Admin => next.run(req).await,
        Some(id) => (
            StatusCode::FORBIDDEN,
            format!(
                "{} needs the admin role; {id} is a {}\n",
                req.uri().path(),
                id.role
            ),
        )
            .into_response(),
        None => (
            StatusCode::FORBIDDEN,
            format!(
                "{} needs a client certificate with the admin role\n",
                req.uri().path()
            ),
        )
            .into_response(),
    }
}
