//! Addresses for test servers: bind `127.0.0.1:0` and read the address back; never pick a
//! "free" port and hope it stays free (on a busy machine an outgoing connection can take it).

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;

/// A listener on an ephemeral loopback port, and the port it got.
pub async fn listener() -> (TcpListener, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let addr = l.local_addr().expect("local address");
    (l, addr)
}

/// A loopback port that is bound but not listening: connections to it are refused (a server
/// that is down), and nobody else can take it until [`ReservedPort::listen`] brings the
/// server up on it.
#[derive(Debug)]
pub struct ReservedPort {
    socket: TcpSocket,
    addr: SocketAddr,
}

impl ReservedPort {
    pub fn new() -> ReservedPort {
        let socket = TcpSocket::new_v4().expect("a TCP socket");
        socket
            .bind("127.0.0.1:0".parse().expect("an address"))
            .expect("bind 127.0.0.1:0");
        let addr = socket.local_addr().expect("local address");
        ReservedPort { socket, addr }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Starts listening on the reserved port.
    pub fn listen(self) -> TcpListener {
        self.socket
            .listen(1024)
            .expect("listen on the reserved port")
    }
}

impl Default for ReservedPort {
    fn default() -> Self {
        ReservedPort::new()
    }
}

/// A fake server running in this process. Dropping it stops it; [`Served::stop`] also waits
/// until it has stopped.
#[derive(Debug)]
pub struct Served {
    pub addr: SocketAddr,
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl Served {
    pub(crate) fn new(addr: SocketAddr, stop: CancellationToken, task: JoinHandle<()>) -> Served {
        Served {
            addr,
            stop,
            task: Some(task),
        }
    }

    /// `http://<addr>`, what a tonic client connects to.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The token that stops the server (cancelled on drop as well).
    pub fn stop_token(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// Stops the server (its open streams end with UNAVAILABLE) and waits until it is gone.
    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(t) = self.task.take() {
            crate::within(crate::PATIENCE, "the fake server stops", t)
                .await
                .expect("the fake server task");
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Serves a fake's `routes` on `listener` until the returned handle is stopped or dropped.
/// On stop `kill` is bumped first, so the fake ends its open streams with UNAVAILABLE and
/// clients see the server go away (tonic's graceful shutdown would wait for them forever).
pub(crate) fn serve_fake(
    listener: TcpListener,
    routes: tonic::service::Routes,
    kill: std::sync::Arc<watch::Sender<u64>>,
    what: &'static str,
) -> Served {
    let addr = listener.local_addr().expect("local address");
    let stop = CancellationToken::new();
    let token = stop.clone();
    let task = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_routes(routes)
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async move {
                token.cancelled().await;
                kill.send_modify(|k| *k += 1);
            })
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    });
    Served::new(addr, stop, task)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_reserved_port_refuses_until_it_listens() {
        let r = ReservedPort::new();
        let addr = r.addr();
        let err = tokio::net::TcpStream::connect(addr)
            .await
            .expect_err("nothing listens yet");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
        let l = r.listen();
        let (accepted, connected) = tokio::join!(l.accept(), tokio::net::TcpStream::connect(addr));
        accepted.expect("accepted");
        connected.expect("connected");
    }
}
