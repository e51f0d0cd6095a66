//! A TCP proxy that injects connection faults between a client and a server: the network
//! between them, as the fault tests need it (`docs/fault-testing.md` in the shared docs).
//!
//! - [`FaultProxy::freeze`]: every connection opened so far stops forwarding in both
//!   directions while both sockets stay open (no FIN, no RST): a partition, a dead node or a
//!   dropped conntrack entry. Only keepalives and timeouts can find it. New connections pass.
//! - [`FaultProxy::cut`]: every connection opened so far is closed at once (both sides see the
//!   socket close), as when the peer's process is killed and its kernel closes the sockets.
//!   Frozen connections are closed too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// Forwards every connection to `upstream` until told otherwise. Dropping it stops accepting
/// and closes every connection.
#[derive(Debug)]
pub struct FaultProxy {
    pub addr: SocketAddr,
    state: Arc<State>,
    stop: CancellationToken,
}

#[derive(Debug)]
struct State {
    accepted: AtomicUsize,
    frozen_below: AtomicUsize,
    /// Cancelled by `cut`: closes the connections accepted under it.
    current: Mutex<CancellationToken>,
    /// Bytes forwarded (both directions), to show traffic went through.
    bytes: AtomicU64,
}

impl FaultProxy {
    /// Listens on `127.0.0.1:0` and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let state = Arc::new(State {
            accepted: AtomicUsize::new(0),
            frozen_below: AtomicUsize::new(0),
            current: Mutex::new(stop.child_token()),
            bytes: AtomicU64::new(0),
        });
        let (st, stopped) = (state.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let down = tokio::select! {
                    _ = stopped.cancelled() => return,
                    r = listener.accept() => match r {
                        Ok((down, _)) => down,
                        Err(_) => continue,
                    },
                };
                // A server that is down refuses: so does the proxy (it closes the connection).
                let Ok(up) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let _ = (down.set_nodelay(true), up.set_nodelay(true));
                let index = st.accepted.fetch_add(1, Ordering::SeqCst);
                let token = st.current.lock().unwrap().clone();
                let (dr, dw) = down.into_split();
                let (ur, uw) = up.into_split();
                tokio::spawn(pump(dr, uw, index, st.clone(), token.clone()));
                tokio::spawn(pump(ur, dw, index, st.clone(), token));
            }
        });
        FaultProxy { addr, state, stop }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops forwarding on every connection opened so far, keeping their sockets open.
    pub fn freeze(&self) {
        let n = self.state.accepted.load(Ordering::SeqCst);
        self.state.frozen_below.store(n, Ordering::SeqCst);
    }

    /// Closes every connection opened so far (frozen ones included).
    pub fn cut(&self) {
        let next = self.stop.child_token();
        let old = std::mem::replace(&mut *self.state.current.lock().unwrap(), next);
        old.cancel();
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.state.accepted.load(Ordering::SeqCst)
    }

    /// Bytes forwarded so far, both directions.
    pub fn bytes(&self) -> u64 {
        self.state.bytes.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Copies `from` to `to` until either side closes or the connection is cut; once its
/// connection is frozen it forwards nothing more but holds both halves open until cut.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    index: usize,
    state: Arc<State>,
    cut: CancellationToken,
) {
    let mut buf = vec![0u8; 16 * 1024];
    let forward = async {
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if index < state.frozen_below.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
            state.bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
    };
    tokio::select! {
        _ = cut.cancelled() => {}
        _ = forward => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn echo() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 64];
                    while let Ok(n) = s.read(&mut b).await {
                        if n == 0 || s.write_all(&b[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn roundtrip(s: &mut TcpStream) -> std::io::Result<usize> {
        s.write_all(b"ping").await?;
        let mut b = [0u8; 4];
        s.read_exact(&mut b).await
    }

    #[tokio::test]
    async fn forwards_freezes_and_cuts() {
        let p = FaultProxy::start(echo().await).await;
        let mut a = TcpStream::connect(p.addr).await.unwrap();
        assert_eq!(roundtrip(&mut a).await.unwrap(), 4);
        p.freeze();
        // Frozen: the write is accepted, no answer comes (bounded wait, not a timing check).
        let frozen = tokio::time::timeout(Duration::from_millis(300), roundtrip(&mut a)).await;
        assert!(frozen.is_err(), "a frozen connection forwards nothing");
        // New connections still pass.
        let mut b = TcpStream::connect(p.addr).await.unwrap();
        assert_eq!(roundtrip(&mut b).await.unwrap(), 4);
        p.cut();
        let mut buf = [0u8; 4];
        let closed =
            crate::within(Duration::from_secs(10), "the cut closes", b.read(&mut buf)).await;
        assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
        assert_eq!(p.connections(), 2);
    }
}
