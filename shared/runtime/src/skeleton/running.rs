//! [`Running`], what a service's `start` returns: its bound addresses ([`BoundAddrs`]), its
//! readiness, the tasks it serves with and [`Running::wait`], which drains them.
//!
//! Separate from the binding functions and `main`: the running service's handle reads on its
//! own.

use super::*;

/// The addresses a service bound, as written to `--ready-file`:
/// `{"grpc": "127.0.0.1:50061", "admin": "127.0.0.1:9061"}` (`"http"` instead of `"grpc"` for
/// the shim), plus one key per optional listener it serves (br-decision's `"ext_proc"`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BoundAddrs {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<SocketAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<SocketAddr>,
    pub admin: SocketAddr,
    /// Optional listeners by key (see [`Running::with_listener`]).
    #[serde(flatten)]
    pub more: std::collections::BTreeMap<String, SocketAddr>,
}

/// A started service: what it bound, whether it is ready, and its serving task. `P` says what
/// `--listen` speaks; `X` holds what only one service has (snapshot's epoch, decision's group
/// stats), reached with [`extra`](Self::extra).
#[derive(Debug)]
pub struct Running<P: Protocol, X = ()> {
    listen: SocketAddr,
    admin: SocketAddr,
    readiness: Readiness,
    shutdown: CancellationToken,
    task: JoinHandle<Result<ServeOutcome, ServeError>>,
    extra: X,
    /// Optional listeners beyond `--listen` and the admin port, by ready-file key.
    more: Vec<(&'static str, SocketAddr)>,
    /// A second, HTTP/JSON listener of a gRPC service (br-decision's `--http-listen`).
    http_json: Option<SocketAddr>,
    /// The service logged its own start-up line, so [`main`] logs no generic one.
    pub(super) announced: bool,
    protocol: PhantomData<P>,
}

impl<P: Protocol, X> Running<P, X> {
    /// Spawns `serve` (the future that serves until `shutdown` and then drains and stops the
    /// service's tasks) and returns the handle. For a service's `start`.
    pub fn spawn<F>(
        listen: SocketAddr,
        admin: SocketAddr,
        readiness: Readiness,
        shutdown: CancellationToken,
        extra: X,
        serve: F,
    ) -> Self
    where
        F: Future<Output = Result<ServeOutcome, ServeError>> + Send + 'static,
    {
        Running {
            listen,
            admin,
            readiness,
            shutdown,
            task: tokio::spawn(serve),
            extra,
            more: Vec::new(),
            http_json: None,
            announced: false,
            protocol: PhantomData,
        }
    }

    /// Records an optional listener the service bound (`key` in the ready file, e.g.
    /// `"ext_proc"`).
    pub fn with_listener(mut self, key: &'static str, addr: SocketAddr) -> Self {
        self.more.push((key, addr));
        self
    }

    /// Says that the service logged its own start-up line (one that names its addresses), so
    /// that [`main`] does not log its generic "NAME listening" after it: an operator reads one
    /// start-up line a process.
    #[must_use]
    pub fn announced(mut self) -> Self {
        self.announced = true;
        self
    }

    /// The address of an optional listener (see [`with_listener`](Self::with_listener)).
    pub fn listener(&self, key: &str) -> Option<SocketAddr> {
        self.more.iter().find(|(k, _)| *k == key).map(|(_, a)| *a)
    }

    /// Where `/metrics`, `/livez` and `/readyz` are served.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
    }

    /// Every bound address (what `--ready-file` holds).
    pub fn addrs(&self) -> BoundAddrs {
        let main = Some(self.listen);
        let (grpc, http) = match P::KEY {
            "grpc" => (main, self.http_json),
            _ => (None, main),
        };
        BoundAddrs {
            grpc,
            http,
            admin: self.admin,
            more: self
                .more
                .iter()
                .map(|(k, a)| ((*k).to_owned(), *a))
                .collect(),
        }
    }

    /// The flag behind `/readyz` (subscribe to it to wait for a change).
    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    pub fn is_ready(&self) -> bool {
        self.readiness.is_ready()
    }

    /// What only this service has.
    pub fn extra(&self) -> &X {
        &self.extra
    }

    /// Waits until the service has stopped (after `shutdown` was cancelled, or after it failed).
    pub async fn wait(self) -> Result<ServeOutcome, ServeError> {
        // The extras may hold handles that keep the service's tasks alive; they are not needed
        // once the caller waits for the end.
        drop(self.extra);
        self.task.await?
    }

    /// Starts the shutdown (as SIGTERM does) and waits for the drain.
    pub async fn stop(self) -> Result<ServeOutcome, ServeError> {
        self.shutdown.cancel();
        self.wait().await
    }
}

impl<X> Running<Grpc, X> {
    /// Where the gRPC service (with health and reflection) listens.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.listen
    }

    /// Records the service's HTTP/JSON listener (served by the same task), so that
    /// [`addrs`](Self::addrs) and `--ready-file` carry it as `"http"` beside `"grpc"`.
    #[must_use]
    pub fn with_http_json(mut self, addr: Option<SocketAddr>) -> Self {
        self.http_json = addr;
        self
    }

    /// Where the HTTP/JSON listener is, if the service has one (br-decision's
    /// `--http-listen`).
    pub fn http_json_addr(&self) -> Option<SocketAddr> {
        self.http_json
    }
}

impl<X> Running<Http, X> {
    /// Where the HTTP proxy listens.
    pub fn http_addr(&self) -> SocketAddr {
        self.listen
    }
}
