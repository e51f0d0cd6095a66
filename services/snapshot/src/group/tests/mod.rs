//! The group's unit tests, one file per concern, and the ONE fixture they share: a group with
//! small settings, builders of the messages ingest and decision send, and a replica that
//! follows a watcher's events the way every decision replica does.
#![allow(clippy::unwrap_used)] // tests may panic on purpose

mod apply;
mod bounds;
mod merging;
mod ownership;
mod props;
mod reserve;
mod watchers;

use super::event::{MERGE_MAX_CHANGES, event_bytes};
use super::queue::{MERGE_MAX_BYTES, Merging as MergedWatchQueue, Overflow};
use super::*;
use crate::wire;
use br_core::Phase;
use br_proto::v1::telemetry_change as tc;
use br_proto::valid::limits;
use br_sigma::{MAX_WORKER_ID, change};
use v1::RejectReason as R;
use v1::watch_event::Kind as Ev;

const S1: StreamId = 1;
const S2: StreamId = 2;

fn settings() -> Settings {
    Settings {
        history: 8,
        reservation_ttl: Duration::from_secs(10),
        worker_grace: Duration::from_secs(5),
        carrier_grace: Duration::from_secs(2),
        progress_interval: Duration::from_millis(250),
        watcher_queue: 4,
        ..Settings::default()
    }
}

fn group_with(s: Settings) -> (Group, Instant) {
    // Only an origin: tokio's Instant has no constant one. Every later instant is this one
    // plus an offset the test chooses.
    let now = Instant::now();
    let m = Metrics::new().unwrap();
    (Group::new("g", 77, Arc::new(s), &m, now), now)
}

fn group() -> (Group, Instant) {
    group_with(settings())
}

fn tc(kind: tc::Kind) -> v1::TelemetryChange {
    v1::TelemetryChange { kind: Some(kind) }
}

fn hello(w: u32, inc: u64, cap: u32) -> v1::TelemetryChange {
    tc(tc::Kind::WorkerHello(tc::WorkerHello {
        worker_id: w,
        incarnation: inc,
        capacity: cap,
        endpoint: format!("http://w{w}"),
    }))
}

fn gone(w: u32, inc: u64, at: u64) -> v1::TelemetryChange {
    tc(tc::Kind::WorkerDisconnected(tc::WorkerDisconnected {
        worker_id: w,
        incarnation: inc,
        disconnected_at_unix_ms: at,
    }))
}

fn prog(w: u32, inc: u64, id: &str, p: u32, g: u32, fin: bool) -> v1::TelemetryChange {
    tc(tc::Kind::RequestProgress(tc::RequestProgress {
        worker_id: w,
        incarnation: inc,
        request_id: id.into(),
        prompt_tokens: p,
        generated_tokens: g,
        finished: fin,
        unkeyed: false,
    }))
}

fn sync(w: u32, inc: u64, ids: &[&str]) -> v1::TelemetryChange {
    tc(tc::Kind::WorkerSync(tc::WorkerSync {
        worker_id: w,
        incarnation: inc,
        request_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
    }))
}

fn res(id: &str, w: u32, inc: u64, p: u32) -> ValidReservation {
    ValidReservation {
        request_id: RequestId::new(id).unwrap(),
        worker_id: w,
        incarnation: inc,
        prompt_tokens: p,
        prompt_hash: Some(1),
        max_tokens: None,
        queue_if_full: false,
        expected_output_tokens: None,
        request_class_id: None,
    }
}

fn reasons(ack: &v1::ApplyAck) -> Vec<(u32, R)> {
    ack.rejected
        .iter()
        .map(|r| (r.index, R::try_from(r.reason).unwrap()))
        .collect()
}

fn load(g: &Group, w: u32) -> u64 {
    g.sigma().cluster().worker(w).unwrap().load()
}

/// What a watcher's queue holds, as its Watch stream sends it.
fn drain(rx: &mut WatchQueue) -> Vec<v1::WatchEvent> {
    let mut out = Vec::new();
    while let Some(e) = rx.try_recv() {
        out.push(wire::watch_event(&e.unwrap()));
    }
    out
}

/// Follows a watcher's events like a replica does; returns the replica.
fn follow(replica: &mut Option<Sigma>, events: &[v1::WatchEvent]) {
    for e in events {
        match e.kind.as_ref().unwrap() {
            Ev::Snapshot(s) => *replica = Some(Sigma::from_snapshot(s).unwrap()),
            Ev::Delta(d) => replica.as_mut().unwrap().apply_delta(d).unwrap(),
            Ev::Progress(_) | Ev::Reset(_) => {}
        }
    }
}

/// Apply and Reserve as the service calls them: messages parsed and answers built by
/// `crate::wire`, so the tests read the acks a client reads.
trait ThroughTheEdge {
    fn apply_msgs(
        &mut self,
        batch_seq: u64,
        changes: Vec<v1::TelemetryChange>,
        stream: StreamId,
        now: Instant,
        wall_ms: u64,
    ) -> v1::ApplyAck;

    fn reserve_msgs(
        &mut self,
        reservations: Vec<ValidReservation>,
        now: Instant,
    ) -> (Vec<String>, Vec<v1::ReservationRejection>);
}

impl ThroughTheEdge for Group {
    fn apply_msgs(
        &mut self,
        batch_seq: u64,
        changes: Vec<v1::TelemetryChange>,
        stream: StreamId,
        now: Instant,
        wall_ms: u64,
    ) -> v1::ApplyAck {
        let wire::Changes { valid, invalid } = wire::telemetry_changes(changes);
        let applied = self.apply(valid, stream, now, wall_ms);
        wire::apply_ack(batch_seq, invalid, applied)
    }

    fn reserve_msgs(
        &mut self,
        reservations: Vec<ValidReservation>,
        now: Instant,
    ) -> (Vec<String>, Vec<v1::ReservationRejection>) {
        let r = wire::reserve_response(self.reserve(reservations, now));
        (r.accepted, r.rejected)
    }
}
