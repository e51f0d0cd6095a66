//! Where the shim sends what it reads: a [`ProgressSink`]. In production the telemetry
//! reporter of `br-client` (it buffers while ingest is away); in tests a [`RecordingSink`].

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// Receives cumulative per-request progress. Must not block: it is called on the path of the
/// client's tokens.
pub trait ProgressSink: Send + Sync + 'static {
    /// The latest cumulative state of one request. `prompt_tokens = 0` means unknown;
    /// `finished` is sticky.
    fn progress(&self, request_id: &str, prompt_tokens: u32, generated: u32, finished: bool);

    /// [`progress`](Self::progress) of a request that came without `X-Request-Id`:
    /// `request_id` is the engine's response id, reported `unkeyed` so σ matches it to a
    /// reservation (the request-id rule). Sinks that cannot tell record it as keyed.
    fn progress_unkeyed(
        &self,
        request_id: &str,
        prompt_tokens: u32,
        generated: u32,
        finished: bool,
    ) {
        self.progress(request_id, prompt_tokens, generated, finished);
    }

    /// Whether the telemetry stream to ingest is up (for the `ingest_connected` gauge).
    fn connected(&self) -> bool {
        true
    }

    /// Streams ended because the snapshot service refused this worker's changes, so far (for
    /// the `ingest_refusals_total` counter).
    fn refusals(&self) -> u64 {
        0
    }

    /// Whether the worker can take work (the shim's engine answers): `false` takes it out of
    /// routing (the reporter ends its stream: SUSPECT in σ), `true` brings it back.
    fn set_serving(&self, _serving: bool) {}

    /// The engine restarted while the worker was out of routing: say the next Hello as a new
    /// incarnation.
    fn renew_incarnation(&self) {}
}

/// One call to [`ProgressSink::progress`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub request_id: String,
    pub prompt_tokens: u32,
    pub generated: u32,
    pub finished: bool,
}

/// A sink that records every report (for tests).
#[derive(Debug, Clone, Default)]
pub struct RecordingSink {
    reports: Arc<Mutex<Vec<Report>>>,
    serving: Arc<Mutex<Vec<bool>>>,
    renewed: Arc<AtomicU32>,
}

impl RecordingSink {
    /// Everything reported so far, in order.
    pub fn reports(&self) -> Vec<Report> {
        match self.reports.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Every [`ProgressSink::set_serving`] call so far, in order.
    pub fn serving_changes(&self) -> Vec<bool> {
        match self.serving.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// How many times [`ProgressSink::renew_incarnation`] was called.
    pub fn incarnations_renewed(&self) -> u32 {
        self.renewed.load(Ordering::Relaxed)
    }

    /// The reports about one request.
    pub fn for_request(&self, id: &str) -> Vec<Report> {
        self.reports()
            .into_iter()
            .filter(|r| r.request_id == id)
            .collect()
    }
}

impl ProgressSink for RecordingSink {
    fn progress(&self, request_id: &str, prompt_tokens: u32, generated: u32, finished: bool) {
        let r = Report {
            request_id: request_id.to_owned(),
            prompt_tokens,
            generated,
            finished,
        };
        match self.reports.lock() {
            Ok(mut g) => g.push(r),
            Err(p) => p.into_inner().push(r),
        }
    }

    fn set_serving(&self, serving: bool) {
        match self.serving.lock() {
            Ok(mut g) => g.push(serving),
            Err(p) => p.into_inner().push(serving),
        }
    }

    fn renew_incarnation(&self) {
        self.renewed.fetch_add(1, Ordering::Relaxed);
    }
}

/// A sink that drops everything (the shim without `--ingest-addr`).
#[derive(Debug, Clone, Copy, Default)]
pub struct NullSink;

impl ProgressSink for NullSink {
    fn progress(&self, _: &str, _: u32, _: u32, _: bool) {}
    fn connected(&self) -> bool {
        false
    }
}

/// The production sink: br-client's telemetry reporter (a bounded map of the latest state per
/// request, batched to ingest; it keeps the state and reconnects while ingest is away).
#[derive(Debug, Clone)]
pub struct ReporterSink(pub br_client::reporter::ReporterHandle);

impl ProgressSink for ReporterSink {
    fn progress(&self, request_id: &str, prompt_tokens: u32, generated: u32, finished: bool) {
        if let Err(e) = self
            .0
            .progress(request_id, prompt_tokens, generated, finished)
        {
            tracing::debug!(request_id, error = %e, "progress not recorded");
        }
    }

    fn progress_unkeyed(
        &self,
        request_id: &str,
        prompt_tokens: u32,
        generated: u32,
        finished: bool,
    ) {
        if let Err(e) = self
            .0
            .progress_unkeyed(request_id, prompt_tokens, generated, finished)
        {
            tracing::debug!(request_id, error = %e, "progress not recorded");
        }
    }

    fn connected(&self) -> bool {
        self.0.is_connected()
    }

    fn refusals(&self) -> u64 {
        self.0.stats().refusals
    }

    fn set_serving(&self, serving: bool) {
        self.0.set_serving(serving);
    }

    fn renew_incarnation(&self) {
        let new = self.0.renew_incarnation();
        tracing::info!(
            incarnation = %format!("{new:016x}"),
            "the engine restarted: its next Hello is a new incarnation"
        );
    }
}
