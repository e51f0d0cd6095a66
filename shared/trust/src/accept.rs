//! What a peer can make a server hold before it has said anything: the accept loop of every
//! gRPC and admin port (plaintext and TLS).
//!
//! - At most [`AcceptLimits::max_connections`] connections are open at once; further ones
//!   wait in the kernel's listen backlog until one closes. Without it a peer opening idle
//!   connections exhausts the process's file descriptors, and then nothing (not even health or
//!   `/metrics`) can be accepted.
//! - At most [`AcceptLimits::max_connections_per_peer`] of them come from one IP address; a
//!   further one from that address is closed as soon as it is accepted (its address is known
//!   only then), so one client, misbehaving or hostile, cannot take every slot from the others.
//! - A connection that sends no byte within [`AcceptLimits::first_byte_timeout`] is closed
//!   (an HTTP/2 client sends its preface, a TLS client its ClientHello, at once): idle
//!   connections cannot pin the connection slots.
//! - An accept error (EMFILE/ENFILE when descriptors run out anyway, ENOBUFS) backs off,
//!   5 ms doubling to 1 s (br-backoff's rule), instead of retrying at once: tonic's own loop
//!   retries immediately, which was measured spinning a core at 99.8%.
//!
//! The stream yields [`Held`] connections: each carries its slot and gives it back when the
//! connection is dropped.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::ops::Deref;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;

/// The default for `--max-connections`: far above what a group's shims, gateways and decision
/// replicas open, far below a typical descriptor limit.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// The default for `--max-connections-per-peer`: a quarter of the whole, so one address cannot
/// hold more than that; far above what one gateway node, shim pod or decision replica opens.
pub const DEFAULT_MAX_CONNECTIONS_PER_PEER: usize = 1024;
/// The default for `--first-byte-timeout`.
pub const DEFAULT_FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(10);
/// Descriptors kept free below the soft `RLIMIT_NOFILE` for everything that is not an accepted
/// connection (outgoing channels, files, the admin port's own connections).
pub const RESERVED_DESCRIPTORS: usize = 64;

const BACKOFF_MIN: Duration = Duration::from_millis(5);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// The bounds of one listening port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcceptLimits {
    /// Connections open at once (at least 1).
    pub max_connections: usize,
    /// Connections open at once from one IP address (at least 1).
    pub max_connections_per_peer: usize,
    /// How long a new connection may stay silent before it is closed.
    pub first_byte_timeout: Duration,
}

impl Default for AcceptLimits {
    fn default() -> Self {
        AcceptLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_peer: DEFAULT_MAX_CONNECTIONS_PER_PEER,
            first_byte_timeout: DEFAULT_FIRST_BYTE_TIMEOUT,
        }
    }
}

/// What happened at the door, for counters: `"accept_error"` (EMFILE …, backing off),
/// `"silent"` (closed: no first byte in time) or `"peer_limit"` (closed: its address already
/// holds `max_connections_per_peer`).
pub type AcceptHook = Arc<dyn Fn(&'static str) + Send + Sync>;

/// An accepted connection holding one of its port's connection slots until it is dropped.
/// Reads and writes go straight to the inner stream; `Deref` gives its accessors
/// (`peer_addr` …).
#[derive(Debug)]
pub struct Held<IO> {
    io: IO,
    _slot: OwnedSemaphorePermit,
    _peer: PeerSlot,
}

/// The connections open per IP address; an address leaves the map with its last connection,
/// so the map holds at most as many entries as there are connections.
#[derive(Debug, Default)]
struct PeerCounts(std::sync::Mutex<HashMap<IpAddr, usize>>);

impl PeerCounts {
    /// One more connection from `ip`, or `None` when it already holds `limit`.
    fn take(self: &Arc<Self>, ip: IpAddr, limit: usize) -> Option<PeerSlot> {
        let ip = ip.to_canonical();
        let mut counts = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = counts.entry(ip).or_insert(0);
        if *n >= limit {
            return None;
        }
        *n += 1;
        Some(PeerSlot {
            counts: Arc::clone(self),
            ip,
        })
    }
}

/// One connection's place in its address's count, given back when dropped.
#[derive(Debug)]
struct PeerSlot {
    counts: Arc<PeerCounts>,
    ip: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut counts = self
            .counts
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = counts.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.ip);
            }
        }
    }
}

impl<IO> Deref for Held<IO> {
    type Target = IO;
    fn deref(&self) -> &IO {
        &self.io
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Held<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Held<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected for Held<IO> {
    type ConnectInfo = IO::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// Accepts `listener`'s connections within `limits` (see the module docs), each with
/// TCP_NODELAY set (with Nagle on, a unary answer's trailers wait for the peer's delayed ACK,
/// up to 40 ms: docs/benchmarks.md, "decision"). The loop stops when the stream is dropped.
pub fn accept(
    listener: TcpListener,
    limits: AcceptLimits,
    on_event: Option<AcceptHook>,
) -> ReceiverStream<io::Result<Held<TcpStream>>> {
    let (tx, rx) = mpsc::channel(64);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let peers = Arc::new(PeerCounts::default());
    tokio::spawn(async move {
        let mut backoff = br_backoff::Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
        loop {
            // A free slot first: at the limit, new connections wait in the backlog.
            let slot = tokio::select! {
                () = tx.closed() => return,
                s = slots.clone().acquire_owned() => match s {
                    Ok(s) => s,
                    Err(_) => return, // never closed
                },
            };
            let (tcp, peer) = tokio::select! {
                () = tx.closed() => return,
                r = listener.accept() => match r {
                    Ok((tcp, from)) => {
                        backoff.reset();
                        (tcp, from)
                    }
                    Err(e) => {
                        let pause = backoff.next_delay();
                        tracing::warn!(error = %e, ?pause, "accept failed; backing off");
                        if let Some(f) = &on_event {
                            f("accept_error");
                        }
                        tokio::select! {
                            () = tx.closed() => return,
                            () = tokio::time::sleep(pause) => {}
                        }
                        continue;
                    }
                },
            };
            let Some(peer_slot) = peers.take(peer.ip(), limits.max_connections_per_peer.max(1))
            else {
                // closed at once (dropped with its global slot): a client that retries meets
                // the same answer until one of its connections ends
                tracing::debug!(%peer, "connection over the per-address limit; closed");
                if let Some(f) = &on_event {
                    f("peer_limit");
                }
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let tx = tx.clone();
            let on_event = on_event.clone();
            // Waiting for the first byte holds only this connection's task (and its slot).
            tokio::spawn(async move {
                // `peek`, not `readable`: readiness can be a false positive on a fresh socket,
                // and a peeked byte stays for the server to read.
                let mut first = [0u8; 1];
                match tokio::time::timeout(limits.first_byte_timeout, tcp.peek(&mut first)).await {
                    Ok(Ok(n)) if n > 0 => {
                        let held = Held {
                            io: tcp,
                            _slot: slot,
                            _peer: peer_slot,
                        };
                        let _ = tx.send(Ok(held)).await;
                    }
                    Ok(Ok(_)) => tracing::debug!("connection closed before its first byte"),
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "connection failed before its first byte")
                    }
                    Err(_) => {
                        tracing::debug!(peer = ?tcp.peer_addr().ok(), "connection silent; closed");
                        if let Some(f) = &on_event {
                            f("silent");
                        }
                    }
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// An `axum::serve::Listener` over [`accept`]: an HTTP port (the shim's proxy) with the same
/// bounds as the gRPC ports.
#[derive(Debug)]
pub struct AcceptListener {
    local: std::net::SocketAddr,
    connections: ReceiverStream<io::Result<Held<TcpStream>>>,
}

impl AcceptListener {
    pub fn new(
        listener: TcpListener,
        limits: AcceptLimits,
        on_event: Option<AcceptHook>,
    ) -> io::Result<AcceptListener> {
        Ok(AcceptListener {
            local: listener.local_addr()?,
            connections: accept(listener, limits, on_event),
        })
    }
}

impl axum::serve::Listener for AcceptListener {
    type Io = Held<TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match tokio_stream::StreamExt::next(&mut self.connections).await {
                Some(Ok(conn)) => {
                    let peer = conn
                        .peer_addr()
                        .unwrap_or_else(|_| std::net::SocketAddr::from(([0, 0, 0, 0], 0)));
                    return (conn, peer);
                }
                Some(Err(_)) => continue, // logged and counted by the loop
                // the loop stopped (never, while the listener lives): park until shutdown
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}

/// `wanted` lowered, if need be, so that the connections plus [`RESERVED_DESCRIPTORS`] fit
/// under the process's soft descriptor limit (`soft_limit`, e.g. from `ulimit -n`); at least 1.
pub fn fit_to_descriptors(wanted: usize, soft_limit: Option<u64>) -> usize {
    let Some(limit) = soft_limit else {
        return wanted.max(1);
    };
    let room = usize::try_from(limit)
        .unwrap_or(usize::MAX)
        .saturating_sub(RESERVED_DESCRIPTORS);
    wanted.min(room).max(1)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may panic on purpose
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio_stream::StreamExt as _;

    const PATIENCE: Duration = Duration::from_secs(20);

    async fn next(s: &mut ReceiverStream<io::Result<Held<TcpStream>>>) -> Held<TcpStream> {
        tokio::time::timeout(PATIENCE, s.next())
            .await
            .expect("a connection within the patience")
            .expect("the stream goes on")
            .expect("accepted")
    }

    #[tokio::test]
    async fn connections_beyond_the_limit_wait_until_a_slot_frees() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let limits = AcceptLimits {
            max_connections: 2,
            first_byte_timeout: PATIENCE,
            ..AcceptLimits::default()
        };
        let mut s = accept(l, limits, None);
        let mut clients = Vec::new();
        for i in 0..3u8 {
            let mut c = TcpStream::connect(addr).await.unwrap();
            c.write_all(&[i]).await.unwrap();
            clients.push(c);
        }
        let mut a = next(&mut s).await;
        let b = next(&mut s).await;
        assert!(a.nodelay().unwrap());
        // the third waits: nothing more is yielded while both slots are held ...
        let third = tokio::time::timeout(Duration::from_millis(200), s.next()).await;
        assert!(
            third.is_err(),
            "a third connection was yielded over the limit"
        );
        // ... and comes once one is dropped, bytes intact
        let mut byte = [0u8; 1];
        a.io.read_exact(&mut byte).await.unwrap();
        drop(a);
        let mut c = next(&mut s).await;
        c.io.read_exact(&mut byte).await.unwrap();
        assert_eq!(byte, [2]);
        drop(b);
    }

    #[tokio::test]
    async fn a_silent_connection_is_closed_and_counted_and_frees_its_slot() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let limits = AcceptLimits {
            max_connections: 1,
            first_byte_timeout: Duration::from_millis(50),
            ..AcceptLimits::default()
        };
        let (ev_tx, mut ev_rx) = tokio::sync::mpsc::unbounded_channel();
        let hook: AcceptHook = Arc::new(move |e| {
            let _ = ev_tx.send(e);
        });
        let mut s = accept(l, limits, Some(hook));
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let ev = tokio::time::timeout(PATIENCE, ev_rx.recv()).await.unwrap();
        assert_eq!(ev, Some("silent"));
        // the server closed it: the client reads EOF
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(PATIENCE, silent.read(&mut buf))
            .await
            .unwrap()
            .unwrap_or(0);
        assert_eq!(n, 0);
        // its slot is free again: a talking client gets through
        let mut talking = TcpStream::connect(addr).await.unwrap();
        talking.write_all(b"x").await.unwrap();
        let _held = next(&mut s).await;
    }

    /// A client connection from `local` (any 127.0.0.0/8 address is this host's) that has
    /// sent one byte.
    async fn client_from(local: [u8; 4], to: std::net::SocketAddr, byte: u8) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind((local, 0).into()).unwrap();
        let mut c = socket.connect(to).await.unwrap();
        c.write_all(&[byte]).await.unwrap();
        c
    }

    #[tokio::test]
    async fn one_address_gets_no_more_than_its_share_and_the_others_still_get_in() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let limits = AcceptLimits {
            max_connections: 8,
            max_connections_per_peer: 2,
            first_byte_timeout: PATIENCE,
        };
        let (ev_tx, mut ev_rx) = tokio::sync::mpsc::unbounded_channel();
        let hook: AcceptHook = Arc::new(move |e| {
            let _ = ev_tx.send(e);
        });
        let mut s = accept(l, limits, Some(hook));
        let _a = client_from([127, 0, 0, 1], addr, 1).await;
        let _b = client_from([127, 0, 0, 1], addr, 2).await;
        let first = next(&mut s).await;
        let _second = next(&mut s).await;
        // a third from the same address is closed at once and counted ...
        let mut over = client_from([127, 0, 0, 1], addr, 3).await;
        let ev = tokio::time::timeout(PATIENCE, ev_rx.recv()).await.unwrap();
        assert_eq!(ev, Some("peer_limit"));
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(PATIENCE, over.read(&mut buf))
            .await
            .unwrap()
            .unwrap_or(0);
        assert_eq!(n, 0, "the connection over the limit was not closed");
        // ... while another address gets in, bytes intact
        let _c = client_from([127, 0, 0, 2], addr, 4).await;
        let mut other = next(&mut s).await;
        assert_eq!(
            other.peer_addr().unwrap().ip(),
            IpAddr::from([127, 0, 0, 2])
        );
        other.io.read_exact(&mut buf).await.unwrap();
        assert_eq!(buf, [4]);
        // once one of the first address's connections ends, it may open another
        drop(first);
        let _d = client_from([127, 0, 0, 1], addr, 5).await;
        let mut again = next(&mut s).await;
        again.io.read_exact(&mut buf).await.unwrap();
        assert_eq!(buf, [5]);
    }

    #[test]
    fn an_address_leaves_the_count_with_its_last_connection() {
        let peers = Arc::new(PeerCounts::default());
        let ip = IpAddr::from([10, 0, 0, 1]);
        let a = peers.take(ip, 2).unwrap();
        let b = peers.take(ip, 2).unwrap();
        assert!(peers.take(ip, 2).is_none());
        // an IPv4 address seen through an IPv6 socket is the same peer
        assert!(peers.take("::ffff:10.0.0.1".parse().unwrap(), 2).is_none());
        drop(a);
        let c = peers.take(ip, 2).unwrap();
        drop((b, c));
        assert!(peers.0.lock().unwrap().is_empty());
    }

    #[test]
    fn the_limit_fits_under_the_descriptor_limit() {
        assert_eq!(fit_to_descriptors(4096, None), 4096);
        assert_eq!(fit_to_descriptors(4096, Some(1 << 20)), 4096);
        assert_eq!(
            fit_to_descriptors(4096, Some(256)),
            256 - RESERVED_DESCRIPTORS
        );
        assert_eq!(fit_to_descriptors(4096, Some(10)), 1);
        assert_eq!(fit_to_descriptors(0, None), 1);
    }
}
