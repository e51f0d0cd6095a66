//! The `--http-listen` listener: connections bounded like `--listen`'s by br-trust's accept
//! loop, each behind mutual TLS when the service has it, with the peer's identity kept for
//! authorisation.
//!
//! Separate from the handler: what a connection is, apart from what a call on it does.

use super::*;

pub(super) type PlainConns = ReceiverStream<io::Result<Held<TcpStream>>>;
pub(super) type TlsConns = ReceiverStream<io::Result<TlsStream<Held<TcpStream>>>>;

/// The `--http-listen` port: connections bounded like `--listen`'s (br-trust's accept loop:
/// `--max-connections`, `--first-byte-timeout`), each behind mutual TLS when the service has
/// it (a client certificate is required, as on the gRPC port).
pub struct JsonListener {
    local: SocketAddr,
    pub(super) conns: Either<PlainConns, TlsConns>,
}

impl std::fmt::Debug for JsonListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonListener")
            .field("local", &self.local)
            .field("tls", &matches!(self.conns, Either::Right(_)))
            .finish()
    }
}

/// Who is on the other end of a connection: its address and, over TLS, the leaf of the
/// certificate it presented (verified against the CA by the handshake); and the connection's
/// local address (with `addr`, what tells the connection apart in the in-flight budget).
#[derive(Debug, Clone)]
pub struct JsonPeer {
    pub addr: SocketAddr,
    pub cert: Option<Arc<[u8]>>,
    pub local: SocketAddr,
}

impl axum::serve::Listener for JsonListener {
    type Io = Either<Held<TcpStream>, TlsStream<Held<TcpStream>>>;
    type Addr = JsonPeer;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let unknown = || SocketAddr::from(([0, 0, 0, 0], 0));
        loop {
            let next = match &mut self.conns {
                Either::Left(plain) => plain.next().await.map(|r| r.map(Either::Left)),
                Either::Right(tls) => tls.next().await.map(|r| r.map(Either::Right)),
            };
            match next {
                Some(Ok(Either::Left(tcp))) => {
                    let addr = tcp.peer_addr().unwrap_or_else(|_| unknown());
                    let local = tcp.local_addr().unwrap_or(self.local);
                    let peer = JsonPeer {
                        addr,
                        cert: None,
                        local,
                    };
                    return (Either::Left(tcp), peer);
                }
                Some(Ok(Either::Right(tls))) => {
                    let (tcp, session) = tls.get_ref();
                    let addr = tcp.peer_addr().unwrap_or_else(|_| unknown());
                    let local = tcp.local_addr().unwrap_or(self.local);
                    let cert = session
                        .peer_certificates()
                        .and_then(|c| c.first())
                        .map(|c| Arc::<[u8]>::from(c.as_ref()));
                    return (Either::Right(tls), JsonPeer { addr, cert, local });
                }
                // logged and counted by the accept loop or the handshake task
                Some(Err(_)) => continue,
                // the acceptor stopped (never, while the listener lives): park until shutdown
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(JsonPeer {
            addr: self.local,
            cert: None,
            local: self.local,
        })
    }
}

/// Binds `addr` (`--http-listen`) with `--listen`'s rules: plaintext only on loopback (unless
/// `--allow-insecure-remote`), else mutual TLS with the service's material; the accept bounds
/// and counters of `edge`.
pub async fn bind(
    common: &CommonArgs,
    edge: &Edge,
    addr: SocketAddr,
) -> Result<JsonListener, StartError> {
    if edge.tls().is_none() {
        common
            .tls
            .check_bind(addr)
            .map_err(|e| StartError::Config(format!("--http-listen: {e}")))?;
    }
    let bind_err = |source| StartError::Bind {
        flag: "--http-listen",
        addr,
        source,
    };
    let listener = TcpListener::bind(addr).await.map_err(bind_err)?;
    let local = listener.local_addr().map_err(bind_err)?;
    let accepted = br_trust::accept::accept(
        listener,
        common.accept_limits(skeleton::descriptor_limit()),
        edge.accept_hook(),
    );
    let conns = match edge.serving() {
        None => Either::Left(accepted),
        Some(tls) => Either::Right(br_trust::tls::incoming(
            accepted,
            tls.material.server_config(&[b"http/1.1"]),
            TLS_HANDSHAKE_TIMEOUT,
            tls.on_handshake_failure,
        )),
    };
    Ok(JsonListener { local, conns })
}

impl JsonListener {
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}
