//! What a peer can make a server hold before it has said anything: the accept loop of every
//! gRPC and admin port (plaintext and TLS).
//!
//! - At most [`AcceptLimits::max_connections`] connections are open at once; further ones
//!   wait in the kernel's listen backlog until one closes. Without it a peer opening idle
//!   connections exhausts the process's file descriptors, and then nothing (not even health or
//!   `/metrics`) can be accepted.
//! - A connection that sends no byte within [`AcceptLimits::first_byte_timeout`] is closed
//!   (an HTTP/2 client sends its preface, a TLS client its ClientHello, at once): idle
//!   connections cannot pin the connection slots.
//! - An accept error (EMFILE/ENFILE when descriptors run out anyway, ENOBUFS) backs off,
//!   5 ms doubling to 1 s (br-backoff's rule), instead of retrying at once: tonic's own loop
//!   retries immediately, which was measured spinning a core at 99.8%.
//!
//! The stream yields [`Held`] connections: each carries its slot and gives it back when the
//! connection is dropped.

use std::io;
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
    /// How long a new connection may stay silent before it is closed.
    pub first_byte_timeout: Duration,
}

impl Default for AcceptLimits {
    fn default() -> Self {
        AcceptLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            first_byte_timeout: DEFAULT_FIRST_BYTE_TIMEOUT,
        }
    }
}

/// What happened at the door, for counters: `"accept_error"` (EMFILE …, backing off) or
/// `"silent"` (closed: no first byte in time).
pub type AcceptHook = Arc<dyn Fn(&'static str) + Send + Sync>;

/// An accepted connection holding one of its port's connection slots until it is dropped.
/// Reads and writes go straight to the inner stream; `Deref` gives its accessors
/// (`peer_addr` …).
#[derive(Debug)]
pub struct Held<IO> {
    io: IO,
    _slot: OwnedSemaphorePermit,
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
            let tcp = tokio::select! {
                () = tx.closed() => return,
                r = listener.accept() => match r {
                    Ok((tcp, _)) => {
                        backoff.reset();
                        tcp
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
