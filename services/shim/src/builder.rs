//! [`Shim`], the proxy's shared state, and its builder: the engine client, the sink, the
//! limits and budgets, the health judge, and how a call to the engine is counted and judged.
//!
//! Separate from the handler: what a shim is configured with, apart from what one request
//! does with it.

use super::*;

/// The proxy's shared state.
pub struct Shim {
    pub(crate) client: reqwest::Client,
    pub(crate) upstream: String,
    pub(crate) inject_usage: bool,
    /// Cleared the first time the engine refuses a request only because of the injected
    /// `stream_options` (it does not support them): from then on the shim counts chunks.
    pub(crate) engine_takes_usage: AtomicBool,
    pub(crate) max_body: usize,
    /// One permit per byte of request body the shim holds to inspect (each buffered body costs
    /// about twice its size: as received and as sent on), so N concurrent large bodies cannot
    /// take N x 2 x `max_body` of memory.
    pub(crate) body_budget: Arc<tokio::sync::Semaphore>,
    pub(crate) max_buffered: usize,
    /// How long a body to inspect may take to arrive (`--body-timeout`).
    pub(crate) body_timeout: std::time::Duration,
    /// One permit per request in flight (held until its response body ends).
    pub(crate) in_flight: Arc<tokio::sync::Semaphore>,
    pub(crate) max_in_flight: usize,
    pub(crate) sink: Arc<dyn ProgressSink>,
    pub(crate) metrics: ShimMetrics,
    /// Told the outcome of every call to the engine.
    pub(crate) health: Arc<health::Health>,
    /// How the engine is told this shim's rank (when one server serves several).
    pub(crate) pin: topology::Pin,
    /// `--require-request-id`: refuse generation requests without `X-Request-Id`.
    pub(crate) require_request_id: bool,
}

impl std::fmt::Debug for Shim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shim")
            .field("upstream", &self.upstream)
            .field("inject_usage", &self.inject_usage)
            .finish_non_exhaustive()
    }
}

/// Why the shim could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    #[error("--upstream {0:?} must be an http:// URL")]
    BadUpstream(String),
    #[error("building the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}

impl Shim {
    /// A shim forwarding to `upstream` (e.g. `http://127.0.0.1:8000`).
    pub fn new(
        upstream: &str,
        inject_usage: bool,
        sink: Arc<dyn ProgressSink>,
        metrics: ShimMetrics,
    ) -> Result<Self, ShimError> {
        let upstream = upstream.trim_end_matches('/').to_owned();
        if !(upstream.starts_with("http://") && upstream.len() > "http://".len()) {
            return Err(ShimError::BadUpstream(upstream));
        }
        let client = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(5))
            .tcp_nodelay(true)
            .build()?;
        Ok(Shim {
            client,
            upstream,
            inject_usage,
            engine_takes_usage: AtomicBool::new(true),
            max_body: DEFAULT_MAX_BODY_BYTES,
            body_budget: Arc::new(tokio::sync::Semaphore::new(DEFAULT_MAX_BUFFERED_BODY_BYTES)),
            max_buffered: DEFAULT_MAX_BUFFERED_BODY_BYTES,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            in_flight: Arc::new(tokio::sync::Semaphore::new(DEFAULT_MAX_CONCURRENT_REQUESTS)),
            max_in_flight: DEFAULT_MAX_CONCURRENT_REQUESTS,
            sink,
            metrics,
            health: Arc::new(health::Health::always_up()),
            pin: topology::Pin::default(),
            require_request_id: false,
        })
    }

    /// Tells the engine this rank on every request (`--dp-rank-header`, `--dp-rank-field`).
    #[must_use]
    pub fn with_pin(mut self, pin: topology::Pin) -> Self {
        self.pin = pin;
        self
    }

    /// Shares `other`'s limits (requests at once, body bytes held, body timeout): the ranks
    /// one shim process serves share its memory and its connections.
    #[must_use]
    pub fn sharing_limits_of(mut self, other: &Shim) -> Self {
        self.max_body = other.max_body;
        self.in_flight = Arc::clone(&other.in_flight);
        self.max_in_flight = other.max_in_flight;
        self.body_budget = Arc::clone(&other.body_budget);
        self.max_buffered = other.max_buffered;
        self.body_timeout = other.body_timeout;
        self.client = other.client.clone();
        self
    }

    /// A refusal in the OpenAI error shape, counted under `reason`.
    pub(crate) fn refuse_for(&self, status: StatusCode, reason: &str, msg: String) -> Response {
        refuse(self, status, reason, msg)
    }

    /// Reports the outcome of every call to the engine to `health` (by default nothing
    /// judges them).
    #[must_use]
    pub fn with_health(mut self, health: Arc<health::Health>) -> Self {
        self.health = health;
        self
    }

    /// A call to the engine failed: counted by kind and judged.
    pub(crate) fn upstream_failed(&self, kind: health::UpstreamError, detail: &str) {
        self.metrics
            .upstream_errors
            .with_label_values(&[kind.label()])
            .inc();
        self.health.proxied_failed(kind, detail);
    }

    /// The engine answered with `status`: a 5xx is a failure, anything else proves it works.
    pub(crate) fn upstream_answered(&self, status: StatusCode) {
        if status.is_server_error() {
            self.upstream_failed(
                health::UpstreamError::Status5xx,
                &format!("answered {status}"),
            );
        } else {
            self.health.proxied_ok();
        }
    }

    /// A call to the engine failed before a response: counted, judged, answered 502.
    pub(crate) fn unreachable(&self, what: &str, e: &reqwest::Error) -> Response {
        let detail = error_chain(e);
        self.upstream_failed(health::UpstreamError::of(e), &detail);
        bad_gateway(format!("{what}: {detail}"))
    }

    /// Refuse generation requests without `X-Request-Id` (`--require-request-id`) instead of
    /// reporting them unkeyed.
    #[must_use]
    pub fn with_request_id_required(mut self, required: bool) -> Self {
        self.require_request_id = required;
        self
    }

    /// The largest request body and the most requests at once (`--max-body-bytes`,
    /// `--max-concurrent-requests`).
    #[must_use]
    pub fn with_limits(mut self, max_body: usize, max_in_flight: usize) -> Self {
        self.max_body = max_body;
        self.max_in_flight = max_in_flight;
        self.in_flight = Arc::new(tokio::sync::Semaphore::new(max_in_flight));
        self
    }

    /// The most request-body bytes buffered at once across all requests
    /// (`--max-buffered-body-bytes`; at least the largest body), and how long one may take to
    /// arrive (`--body-timeout`).
    #[must_use]
    pub fn with_body_budget(mut self, max_buffered: usize, timeout: std::time::Duration) -> Self {
        let max_buffered = max_buffered.clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
        self.max_buffered = max_buffered;
        self.body_budget = Arc::new(tokio::sync::Semaphore::new(max_buffered));
        self.body_timeout = timeout;
        self
    }

    pub fn metrics(&self) -> &ShimMetrics {
        &self.metrics
    }

    pub fn sink(&self) -> &Arc<dyn ProgressSink> {
        &self.sink
    }
}
