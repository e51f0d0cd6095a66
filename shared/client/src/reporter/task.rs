//! The reporter's background task: connect to the next ingest address, send Hello and a full
//! state, then the changes every flush interval (the first change after a quiet interval at
//! once), heartbeats and the full states an ack asks for; reconnect with backoff (and a new
//! incarnation when refused) when the stream ends.
//!
//! Separate from the handle's synchronous API: everything here awaits the network, nothing in
//! the handle does.

use super::*;

/// Why one connection ended.
enum Ended {
    /// The handle asked to stop.
    Closed,
    /// Connect failed or the stream broke; retry later (on the next address).
    Lost(String),
    /// Ingest ended the stream with ABORTED: the snapshot service refused this worker's
    /// changes. Retry with a new incarnation.
    Refused(String),
    /// The worker stopped serving ([`ReporterHandle::set_serving`]): the stream was ended
    /// cleanly; reconnect (same incarnation) once it serves again.
    Held,
}

/// A random non-zero incarnation other than `old`.
pub(super) fn new_incarnation(old: u64) -> u64 {
    let mut rng = rand::rng();
    loop {
        let v: u64 = rng.random();
        if v != 0 && v != old {
            return v;
        }
    }
}

/// How a stream's ending status is handled.
fn ended_by(status: &tonic::Status) -> Ended {
    let why = format!("{}: {}", status.code(), status.message());
    if status.code() == tonic::Code::Aborted {
        Ended::Refused(why)
    } else {
        Ended::Lost(why)
    }
}

pub(super) async fn run(
    shared: Arc<Shared>,
    endpoints: Vec<tonic::transport::Endpoint>,
    mut hello: v1::Hello,
    full_state_every: Duration,
    tuning: ReporterTuning,
) {
    // Strictly increasing per (worker, incarnation), across reconnects too (and across a new
    // incarnation: it only has to rise).
    let mut seq: u64 = 0;
    let mut backoff = Backoff::new(tuning.backoff_initial, tuning.backoff_max);
    let mut at = 0usize;
    let mut serving = shared.serving.subscribe();
    loop {
        if shared.is_closed() {
            return;
        }
        if !*serving.borrow_and_update() {
            tokio::select! {
                gone = async { serving.wait_for(|s| *s).await.is_err() } => if gone { return },
                () = shared.close_notify.notified() => return,
            }
            tracing::info!("the worker serves again; reconnecting to ingest");
            backoff.reset();
        }
        let endpoint = &endpoints[at % endpoints.len()];
        shared
            .ingest_index
            .store(at % endpoints.len(), Ordering::Relaxed);
        hello.incarnation = shared.incarnation.load(Ordering::Relaxed);
        let ended = connection(
            &shared,
            endpoint,
            &hello,
            full_state_every,
            &tuning,
            &mut seq,
            &mut backoff,
        )
        .await;
        shared.connected.store(false, Ordering::Relaxed);
        let delay = match ended {
            Ended::Closed => return,
            Ended::Held => continue,
            Ended::Lost(why) => {
                // The next replica (the same one when there is only one).
                at = (at + 1) % endpoints.len();
                let delay = backoff.next_delay();
                tracing::warn!(
                    ingest = %endpoint.uri(), next = %endpoints[at].uri(), error = %why,
                    retry_in = ?delay,
                    "telemetry stream to ingest lost; keeping state and reconnecting"
                );
                delay
            }
            Ended::Refused(why) => {
                let old = hello.incarnation;
                let new = new_incarnation(old);
                shared.incarnation.store(new, Ordering::Relaxed);
                shared.refusals.fetch_add(1, Ordering::Relaxed);
                let delay = backoff.next_delay();
                tracing::warn!(
                    ingest = %endpoint.uri(), error = %why, old_incarnation = old,
                    new_incarnation = new, retry_in = ?delay,
                    "the snapshot service refused this worker's changes; saying Hello again as a new incarnation with a full state"
                );
                delay
            }
        };
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shared.close_notify.notified() => return,
        }
    }
}

/// One stream to ingest: Hello, full state, then batched progress until it breaks or the
/// handle closes.
async fn connection(
    shared: &Shared,
    endpoint: &tonic::transport::Endpoint,
    hello: &v1::Hello,
    full_state_every: Duration,
    tuning: &ReporterTuning,
    seq: &mut u64,
    backoff: &mut Backoff,
) -> Ended {
    let channel = tokio::select! {
        r = br_trust::tls::connect(endpoint, shared.tls.as_ref(), Some(br_trust::Role::Ingest)) => match r {
            Ok(c) => c,
            Err(e) => return Ended::Lost(format!("connect: {e}")),
        },
        () = shared.close_notify.notified() => return Ended::Closed,
    };
    shared.connects.fetch_add(1, Ordering::Relaxed);
    let mut client = v1::telemetry_client::TelemetryClient::new(br_trace::traced(channel));
    let (tx, rx) = mpsc::channel::<v1::WorkerReport>(OUTBOUND_QUEUE);

    // Hello and the full state go first; the queue has room for both.
    let hello_msg = v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Hello(hello.clone())),
    };
    if tx.try_send(hello_msg).is_err() {
        return Ended::Lost("outbound queue unavailable".into());
    }
    shared.full_state_requested.store(false, Ordering::Relaxed);
    // Quiet from here: the first change after the full state goes at once. Set before the
    // state is taken, so a change recorded in between wakes the loop below rather than
    // waiting for the first flush.
    shared.quiet.store(true, Ordering::Relaxed);
    let full = full_state(shared, seq);
    if tx.try_send(full).is_err() {
        return Ended::Lost("outbound queue unavailable".into());
    }
    let mut last_full = Instant::now();
    let mut last_sent = Instant::now();

    let mut acks = tokio::select! {
        r = client.report(ReceiverStream::new(rx)) => match r {
            Ok(resp) => resp.into_inner(),
            Err(status) => return ended_by(&status),
        },
        () = shared.close_notify.notified() => return Ended::Closed,
    };

    // The first flush is an interval after the full state; a change recorded after it (and
    // not in it) has gone at the leading edge (`quiet` was set before the full state was taken).
    let mut tick = tokio::time::interval_at(
        tokio::time::Instant::now() + tuning.flush_interval,
        tuning.flush_interval,
    );
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut held = shared.serving.subscribe();
    loop {
        tokio::select! {
            msg = acks.message() => match msg {
                Ok(Some(ack)) => {
                    if !shared.connected.swap(true, Ordering::Relaxed) {
                        backoff.reset();
                        tracing::info!(ingest = %endpoint.uri(), "telemetry stream to ingest up");
                    }
                    shared.on_ack(&ack);
                }
                Ok(None) => return Ended::Lost("ingest ended the stream".into()),
                Err(status) => return ended_by(&status),
            },
            () = shared.change_notify.notified() => {
                // The leading edge: the first change after a quiet flush interval goes now,
                // and the next flush is a whole interval later, so a busy stream still sends
                // at most one message per interval while a lone token is not held back by
                // it (the shim's default interval is chosen for the busy case).
                if tx.capacity() == 0 {
                    continue;
                }
                if let Some(msg) = changed_state(shared, seq) {
                    last_sent = Instant::now();
                    tick.reset();
                    send_checked(shared, &tx, msg);
                }
            }
            _ = tick.tick() => {
                // Only build a message when the stream can take it; otherwise the state keeps
                // coalescing in the map.
                if tx.capacity() == 0 {
                    continue;
                }
                let now = Instant::now();
                let since_full = now.duration_since(last_full);
                // Requested full states at most every MIN_FULL_STATE_GAP: a rejected message
                // asks for one, and a worker being rate limited must not answer every
                // rejection with its whole state.
                let requested = since_full >= MIN_FULL_STATE_GAP
                    && shared.full_state_requested.swap(false, Ordering::Relaxed);
                let msg = if requested || since_full >= full_state_every {
                    shared.full_state_requested.store(false, Ordering::Relaxed);
                    last_full = now;
                    Some(full_state(shared, seq))
                } else {
                    changed_state(shared, seq).or_else(|| {
                        (now.duration_since(last_sent) >= tuning.heartbeat_every).then(|| {
                            *seq += 1;
                            v1::WorkerReport {
                                kind: Some(v1::worker_report::Kind::Heartbeat(v1::Heartbeat {
                                    seq: *seq,
                                })),
                            }
                        })
                    })
                };
                // Nothing changed for a whole interval: let the next change go at once.
                shared.quiet.store(msg.is_none(), Ordering::Relaxed);
                if let Some(msg) = msg {
                    last_sent = now;
                    send_checked(shared, &tx, msg);
                }
            }
            gone = async { held.wait_for(|s| !*s).await.is_err() } => {
                if gone {
                    return Ended::Closed;
                }
                // The worker stops serving: its last changes, then a clean end of the stream
                // (ingest marks it SUSPECT at once).
                tracing::warn!(ingest = %endpoint.uri(),
                    "the worker stopped serving; ending the telemetry stream until it serves again");
                if let Some(msg) = changed_state(shared, seq)
                    && tx.try_send(msg).is_ok()
                {
                    shared.reports_sent.fetch_add(1, Ordering::Relaxed);
                }
                drop(tx);
                let drain = async {
                    while let Ok(Some(ack)) = acks.message().await {
                        shared.on_ack(&ack);
                    }
                };
                let _ = tokio::time::timeout(Duration::from_millis(500), drain).await;
                return Ended::Held;
            }
            () = shared.close_notify.notified() => {
                // Last words: what changed since the last message, then end the stream and
                // give ingest a moment to acknowledge.
                if let Some(msg) = changed_state(shared, seq)
                    && tx.try_send(msg).is_ok()
                {
                    shared.reports_sent.fetch_add(1, Ordering::Relaxed);
                }
                drop(tx);
                let drain = async {
                    while let Ok(Some(ack)) = acks.message().await {
                        shared.on_ack(&ack);
                    }
                };
                let _ = tokio::time::timeout(Duration::from_millis(500), drain).await;
                return Ended::Closed;
            }
        }
    }
}

/// Sends a report on a stream whose capacity the caller checked, and counts it.
fn send_checked(shared: &Shared, tx: &mpsc::Sender<v1::WorkerReport>, msg: v1::WorkerReport) {
    shared.reports_sent.fetch_add(1, Ordering::Relaxed);
    if tx.try_send(msg).is_err() {
        // Cannot happen with one producer that checked capacity; the next full state
        // repairs it anyway.
        shared.full_state_requested.store(true, Ordering::Relaxed);
    }
}

fn full_state(shared: &Shared, seq: &mut u64) -> v1::WorkerReport {
    *seq += 1;
    let updates = shared.lock().take_full(*seq);
    shared
        .updates_sent
        .fetch_add(updates.len() as u64, Ordering::Relaxed);
    shared.full_states_sent.fetch_add(1, Ordering::Relaxed);
    let trace = message_trace(*seq, updates.len(), true);
    v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Progress(v1::Progress {
            seq: *seq,
            updates,
            full_state: true,
            traceparent: trace.traceparent,
            tracestate: trace.tracestate,
        })),
    }
}

/// The trace context of one Progress message (empty unless traces are exported): the root
/// of the message's own trace, a short producer span, which ingest's span of the message and
/// the snapshot service's span applying its changes continue.
fn message_trace(seq: u64, updates: usize, full_state: bool) -> br_trace::W3c {
    if !br_trace::enabled() {
        return br_trace::W3c::default();
    }
    let span = tracing::info_span!(
        parent: None,
        "report_batch",
        otel.name = "balanceroute.v1.Telemetry/Report batch",
        otel.kind = "producer",
        seq,
        updates,
        full_state,
    );
    br_trace::W3c::of(&span)
}

fn changed_state(shared: &Shared, seq: &mut u64) -> Option<v1::WorkerReport> {
    let mut st = shared.lock();
    if st.dirty.is_empty() {
        return None;
    }
    *seq += 1;
    let updates = st.take_dirty(*seq, limits::MAX_UPDATES_PER_PROGRESS);
    drop(st);
    shared
        .updates_sent
        .fetch_add(updates.len() as u64, Ordering::Relaxed);
    let trace = message_trace(*seq, updates.len(), false);
    Some(v1::WorkerReport {
        kind: Some(v1::worker_report::Kind::Progress(v1::Progress {
            seq: *seq,
            updates,
            full_state: false,
            traceparent: trace.traceparent,
            tracestate: trace.tracestate,
        })),
    })
}
