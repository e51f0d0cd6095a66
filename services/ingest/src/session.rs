//! One telemetry stream after its Hello: the sequence gate, the cumulative state of the
//! worker's requests, the rate limit and every per-message check. Pure (no I/O, no async), so
//! the rules are unit- and property-tested without a network; `service` drives it.

use std::time::Instant;

use br_proto::v1;
use br_proto::v1::worker_report::Kind;
use br_proto::valid::{RequestId, ValidHello, ValidProgress, limits};
use rustc_hash::FxHashMap;

use crate::change::{Change, Cumulative};
use crate::error::StreamError;

/// Consecutive rate-limited messages after which the stream is ended (RESOURCE_EXHAUSTED).
pub const FLOOD_STRIKES: u32 = 100;

/// Per-stream limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most request updates in one Progress (≤ the contract's 16,384).
    pub max_updates_per_message: usize,
    /// Token bucket rate: progress events per second (a message costs max(updates, 1)).
    pub max_events_per_sec: u32,
    /// Most requests one stream may have tracked at once (finished ones included until the
    /// next full state drops them).
    pub max_tracked: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_updates_per_message: limits::MAX_UPDATES_PER_PROGRESS,
            max_events_per_sec: 250_000,
            max_tracked: 4 * limits::MAX_UPDATES_PER_PROGRESS,
        }
    }
}

/// A message the stream drops but survives: acked REJECTED (or STALE_SEQ).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// The `reason` label.
    pub reason: &'static str,
    /// For the ack's `detail`.
    pub detail: String,
}

/// What to answer to one message.
#[derive(Debug)]
pub struct Reply {
    /// The ack's seq (the highest seq processed).
    pub seq: u64,
    /// OK, REJECTED or STALE_SEQ (the service turns OK into BUFFERED while the snapshot
    /// service is away).
    pub status: v1::AckStatus,
    /// Set for REJECTED and STALE_SEQ.
    pub rejection: Option<Rejection>,
    /// Ask the worker for a full state.
    pub full_state_requested: bool,
    /// Changes for the snapshot service (empty when nothing changed).
    pub changes: Vec<Change>,
    /// Request updates accepted.
    pub events: u64,
    /// The worker repeated its Hello with a new capacity or endpoint.
    pub new_hello: Option<ValidHello>,
}

/// The outcome of one message.
#[derive(Debug)]
pub enum Step {
    Reply(Reply),
    End(StreamError),
}

#[derive(Debug, Clone, Copy)]
struct Tracked {
    state: Cumulative,
    /// The full-state generation that last listed it.
    seen: u64,
}

/// A token bucket.
#[derive(Debug)]
struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn new(rate: u32, burst: usize, now: Instant) -> Self {
        let burst = (burst as f64).max(f64::from(rate));
        Bucket {
            rate: f64::from(rate),
            burst,
            tokens: burst,
            last: now,
        }
    }

    fn take(&mut self, n: usize, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        let n = n as f64;
        if self.tokens >= n {
            self.tokens -= n;
            true
        } else {
            false
        }
    }
}

/// The state of one stream after its Hello.
#[derive(Debug)]
pub struct Session {
    hello: ValidHello,
    limits: Limits,
    last_seq: u64,
    requests: FxHashMap<RequestId, Tracked>,
    full_gen: u64,
    bucket: Bucket,
    strikes: u32,
}

impl Session {
    /// A session for a worker whose Hello was accepted.
    pub fn new(hello: ValidHello, limits: Limits, now: Instant) -> Session {
        Session {
            hello,
            bucket: Bucket::new(
                limits.max_events_per_sec,
                limits.max_updates_per_message,
                now,
            ),
            limits,
            last_seq: 0,
            requests: FxHashMap::default(),
            full_gen: 0,
            strikes: 0,
        }
    }

    pub fn hello(&self) -> &ValidHello {
        &self.hello
    }

    /// The cumulative state of one request as this stream knows it.
    pub fn state_of(&self, request_id: &str) -> Option<Cumulative> {
        self.requests.get(request_id).map(|t| t.state)
    }

    /// Every tracked request (finished ones until a full state drops them).
    pub fn tracked(&self) -> impl Iterator<Item = (&RequestId, Cumulative)> {
        self.requests.iter().map(|(k, t)| (k, t.state))
    }

    fn reply(&self, status: v1::AckStatus) -> Reply {
        Reply {
            seq: self.last_seq,
            status,
            rejection: None,
            full_state_requested: false,
            changes: Vec::new(),
            events: 0,
            new_hello: None,
        }
    }

    fn reject(&self, reason: &'static str, detail: String, full_state: bool) -> Step {
        Step::Reply(Reply {
            rejection: Some(Rejection { reason, detail }),
            full_state_requested: full_state,
            ..self.reply(v1::AckStatus::Rejected)
        })
    }

    /// Handles one message received after the Hello.
    pub fn on_message(&mut self, msg: v1::WorkerReport, now: Instant) -> Step {
        match msg.kind {
            None => self.reject("missing", "WorkerReport.kind is missing".into(), false),
            Some(Kind::Hello(h)) => self.on_hello(h),
            Some(Kind::Heartbeat(hb)) => {
                if let Some(limited) = self.rate_limit(0, now) {
                    return limited;
                }
                if hb.seq == 0 {
                    return self.reject("out_of_range", "seq must be at least 1".into(), false);
                }
                if let Some(stale) = self.gate(hb.seq) {
                    return stale;
                }
                self.last_seq = hb.seq;
                Step::Reply(self.reply(v1::AckStatus::Ok))
            }
            Some(Kind::Progress(p)) => self.on_progress(p, now),
        }
    }

    fn on_hello(&mut self, h: v1::Hello) -> Step {
        let h = match ValidHello::try_from(h) {
            Ok(h) => h,
            Err(e) => return Step::End(StreamError::InvalidHello(e)),
        };
        if h.group != self.hello.group
            || h.worker_id != self.hello.worker_id
            || h.incarnation != self.hello.incarnation
        {
            return Step::End(StreamError::IdentityChanged {
                group: h.group.to_string(),
                worker_id: h.worker_id,
                incarnation: h.incarnation,
            });
        }
        // The same identity again: harmless; a new capacity or endpoint is passed on.
        let mut r = self.reply(v1::AckStatus::Ok);
        if h != self.hello {
            r.changes.push(Change::hello(&h));
            r.new_hello = Some(h.clone());
            self.hello = h;
        }
        Step::Reply(r)
    }

    /// `Some(STALE_SEQ reply)` if `seq` is not above the last accepted one. A seq below it
    /// means a message may have been lost to reordering: ask for a full state.
    ///
    /// Seq `u64::MAX` ends the stream (OUT_OF_RANGE) without being applied: accepted, it would
    /// leave no seq for any later message, and every one would be STALE_SEQ while the stream
    /// lived, its worker LIVE in σ on a state that no longer moves. The gate is per stream, so
    /// the shim's next stream (Hello and a full state, as after any end) starts a new seq space.
    fn gate(&self, seq: u64) -> Option<Step> {
        if seq == u64::MAX {
            return Some(Step::End(StreamError::SeqExhausted {
                last: self.last_seq,
            }));
        }
        (seq <= self.last_seq).then(|| {
            Step::Reply(Reply {
                rejection: Some(Rejection {
                    reason: "stale_seq",
                    detail: format!("seq {seq} is not above {}", self.last_seq),
                }),
                full_state_requested: seq < self.last_seq,
                ..self.reply(v1::AckStatus::StaleSeq)
            })
        })
    }

    /// The token bucket: a message costs max(updates, 1). `Some` when over the limit (a
    /// rejection, or the end of the stream after `FLOOD_STRIKES` in a row).
    fn rate_limit(&mut self, updates: usize, now: Instant) -> Option<Step> {
        if self.bucket.take(updates.max(1), now) {
            self.strikes = 0;
            return None;
        }
        self.strikes += 1;
        if self.strikes >= FLOOD_STRIKES {
            return Some(Step::End(StreamError::Flood {
                limit: self.limits.max_events_per_sec,
            }));
        }
        Some(self.reject(
            "rate_limited",
            format!(
                "over the limit of {} progress events/s for this stream",
                self.limits.max_events_per_sec
            ),
            false,
        ))
    }

    fn on_progress(&mut self, p: v1::Progress, now: Instant) -> Step {
        let n = p.updates.len();
        if n > self.limits.max_updates_per_message {
            return self.reject(
                "too_many_updates",
                format!(
                    "{n} updates in one message, at most {} are allowed",
                    self.limits.max_updates_per_message
                ),
                false,
            );
        }
        if let Some(limited) = self.rate_limit(n, now) {
            return limited;
        }
        let v = match ValidProgress::try_from(p) {
            Ok(v) => v,
            Err(e) => return self.reject(e.reason_label(), e.to_string(), true),
        };
        if let Some(stale) = self.gate(v.seq) {
            return stale;
        }
        // Checks that need the tracked state, before anything is applied (a message is
        // applied whole or not at all).
        let mut new_ids = 0usize;
        for u in &v.updates {
            let incoming = Cumulative {
                prompt_tokens: u.prompt_tokens,
                generated_tokens: u.generated_tokens,
                finished: u.finished,
                unkeyed: u.unkeyed,
            };
            let merged = match self.requests.get(&u.request_id) {
                Some(t) => t.state.merged(incoming),
                None => {
                    new_ids += 1;
                    incoming
                }
            };
            if merged.load() > u64::from(limits::MAX_TOKENS) {
                return self.reject(
                    "too_many_tokens",
                    format!(
                        "request {:?}: prompt_tokens + generated_tokens = {}, at most {} are allowed",
                        u.request_id.as_str(),
                        merged.load(),
                        limits::MAX_TOKENS
                    ),
                    false,
                );
            }
        }
        if self.requests.len() + new_ids > self.limits.max_tracked {
            // Finished requests are only kept to keep `finished` sticky; drop them first.
            self.requests.retain(|_, t| !t.state.finished);
            if self.requests.len() + new_ids > self.limits.max_tracked {
                return self.reject(
                    "too_many_requests",
                    format!(
                        "more than {} requests tracked for this worker",
                        self.limits.max_tracked
                    ),
                    false,
                );
            }
        }

        self.last_seq = v.seq;
        let full = v.full_state;
        if full {
            self.full_gen += 1;
        }
        let generation = self.full_gen;
        let worker_id = self.hello.worker_id;
        let incarnation = self.hello.incarnation;
        let mut r = self.reply(v1::AckStatus::Ok);
        r.events = n as u64;
        r.changes.reserve(n + usize::from(full));
        let mut listed = Vec::with_capacity(if full { n } else { 0 });
        for u in v.updates {
            let incoming = Cumulative {
                prompt_tokens: u.prompt_tokens,
                generated_tokens: u.generated_tokens,
                finished: u.finished,
                unkeyed: u.unkeyed,
            };
            let (changed, state) = match self.requests.get_mut(&u.request_id) {
                Some(t) => {
                    let changed = t.state.merge(incoming);
                    if full {
                        t.seen = generation;
                    }
                    (changed, t.state)
                }
                None => {
                    self.requests.insert(
                        u.request_id.clone(),
                        Tracked {
                            state: incoming,
                            seen: generation,
                        },
                    );
                    (true, incoming)
                }
            };
            if full {
                listed.push(u.request_id.clone());
            }
            // A full state re-sends everything: σ may be being rebuilt.
            if changed || full {
                r.changes.push(Change::Progress {
                    worker_id,
                    incarnation,
                    request_id: u.request_id,
                    state,
                });
            }
        }
        if full {
            self.requests.retain(|_, t| t.seen == generation);
            r.changes.push(Change::Sync {
                worker_id,
                incarnation,
                request_ids: listed,
            });
        }
        Step::Reply(r)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use br_proto::valid::GroupId;
    use br_runtime::error::ServiceError as _;

    pub(crate) fn hello() -> ValidHello {
        ValidHello {
            group: GroupId::new("g0").unwrap(),
            worker_id: 2,
            incarnation: 77,
            capacity: 8,
            endpoint: String::new(),
        }
    }

    fn progress(seq: u64, full: bool, ups: &[(&str, u32, u32, bool)]) -> v1::WorkerReport {
        v1::WorkerReport {
            kind: Some(Kind::Progress(v1::Progress {
                seq,
                full_state: full,
                updates: ups
                    .iter()
                    .map(|(id, p, g, f)| v1::RequestProgress {
                        request_id: (*id).into(),
                        prompt_tokens: *p,
                        generated_tokens: *g,
                        finished: *f,
                        unkeyed: false,
                    })
                    .collect(),
                traceparent: String::new(),
                tracestate: String::new(),
            })),
        }
    }

    fn reply(s: Step) -> Reply {
        match s {
            Step::Reply(r) => r,
            Step::End(e) => panic!("stream ended: {e}"),
        }
    }

    fn session() -> Session {
        Session::new(hello(), Limits::default(), Instant::now())
    }

    #[test]
    fn progress_is_cumulative_and_deduplicated() {
        let mut s = session();
        let now = Instant::now();
        let r = reply(s.on_message(progress(1, false, &[("a", 5, 1, false)]), now));
        assert_eq!(
            (r.status, r.seq, r.changes.len()),
            (v1::AckStatus::Ok, 1, 1)
        );
        // Same values again (new seq): nothing changes, nothing is emitted.
        let r = reply(s.on_message(progress(2, false, &[("a", 5, 1, false)]), now));
        assert_eq!((r.status, r.changes.len()), (v1::AckStatus::Ok, 0));
        // Backwards: absorbed by max(), not an error.
        let r = reply(s.on_message(progress(3, false, &[("a", 5, 0, false)]), now));
        assert_eq!((r.status, r.changes.len()), (v1::AckStatus::Ok, 0));
        assert_eq!(s.state_of("a").unwrap().generated_tokens, 1);
        // Duplicate seq: STALE_SEQ, no change, no full state needed.
        let r = reply(s.on_message(progress(3, false, &[("a", 5, 9, false)]), now));
        assert_eq!(r.status, v1::AckStatus::StaleSeq);
        assert!(r.changes.is_empty() && !r.full_state_requested);
        // Reordered (older seq): STALE_SEQ and a full state is requested.
        let r = reply(s.on_message(progress(2, false, &[("a", 5, 9, false)]), now));
        assert_eq!(r.status, v1::AckStatus::StaleSeq);
        assert!(r.full_state_requested);
        assert_eq!(s.state_of("a").unwrap().generated_tokens, 1);
    }

    #[test]
    fn full_state_emits_everything_and_a_sync() {
        let mut s = session();
        let now = Instant::now();
        reply(s.on_message(
            progress(1, false, &[("a", 5, 1, false), ("b", 5, 1, true)]),
            now,
        ));
        let r = reply(s.on_message(progress(2, true, &[("a", 5, 1, false)]), now));
        assert_eq!(r.changes.len(), 2, "unchanged a is re-sent, then the sync");
        let Change::Sync { request_ids, .. } = &r.changes[1] else {
            panic!("{:?}", r.changes)
        };
        assert_eq!(request_ids.len(), 1);
        assert_eq!(request_ids[0].as_str(), "a");
        assert!(s.state_of("b").is_none(), "unlisted requests are forgotten");
    }

    #[test]
    fn bad_messages_are_rejected_without_changes() {
        let mut s = Session::new(
            hello(),
            Limits {
                max_updates_per_message: 2,
                ..Limits::default()
            },
            Instant::now(),
        );
        let now = Instant::now();
        let cases: Vec<(v1::WorkerReport, &str)> = vec![
            (v1::WorkerReport { kind: None }, "missing"),
            (
                progress(
                    1,
                    false,
                    &[("a", 1, 1, false), ("b", 1, 1, false), ("c", 1, 1, false)],
                ),
                "too_many_updates",
            ),
            (
                progress(1, false, &[("a", 1, 10_000_001, false)]),
                "out_of_range",
            ),
            (progress(1, false, &[("", 1, 1, false)]), "empty"),
            (
                progress(1, false, &[("a", 1, 1, false), ("a", 1, 2, false)]),
                "duplicate",
            ),
            (progress(0, false, &[("a", 1, 1, false)]), "out_of_range"),
            (
                progress(1, false, &[("a", 6_000_000, 6_000_000, false)]),
                "too_many_tokens",
            ),
        ];
        for (m, reason) in cases {
            let r = reply(s.on_message(m, now));
            assert_eq!(r.status, v1::AckStatus::Rejected);
            assert_eq!(r.rejection.as_ref().unwrap().reason, reason);
            assert!(r.changes.is_empty());
        }
        // Overflow through the cumulative state: prompt first, generated later.
        reply(s.on_message(progress(1, false, &[("a", 9_000_000, 0, false)]), now));
        let r = reply(s.on_message(progress(2, false, &[("a", 0, 1_000_001, false)]), now));
        assert_eq!(r.rejection.unwrap().reason, "too_many_tokens");
        assert_eq!(s.state_of("a").unwrap().generated_tokens, 0);
    }

    #[test]
    fn hello_rules_after_the_first() {
        let mut s = session();
        let now = Instant::now();
        let same = v1::WorkerReport {
            kind: Some(Kind::Hello(v1::Hello {
                group: "g0".into(),
                worker_id: 2,
                incarnation: 77,
                capacity: 16,
                endpoint: String::new(),
            })),
        };
        let r = reply(s.on_message(same.clone(), now));
        assert_eq!(r.changes.len(), 1, "new capacity is passed on");
        assert!(r.new_hello.is_some());
        let r = reply(s.on_message(same, now));
        assert!(r.changes.is_empty());
        let other = v1::WorkerReport {
            kind: Some(Kind::Hello(v1::Hello {
                group: "g0".into(),
                worker_id: 3,
                incarnation: 77,
                capacity: 16,
                endpoint: String::new(),
            })),
        };
        assert!(matches!(
            s.on_message(other, now),
            Step::End(StreamError::IdentityChanged { worker_id: 3, .. })
        ));
    }

    #[test]
    fn rate_limit_rejects_then_ends_a_flood() {
        let mut s = Session::new(
            hello(),
            Limits {
                max_events_per_sec: 10,
                max_updates_per_message: 4,
                ..Limits::default()
            },
            Instant::now(),
        );
        let now = Instant::now();
        // Burst of 10 tokens: 10 messages pass (time is frozen), then rejections.
        for seq in 1..=10 {
            assert_eq!(
                reply(s.on_message(progress(seq, false, &[]), now)).status,
                v1::AckStatus::Ok
            );
        }
        let r = reply(s.on_message(progress(11, false, &[]), now));
        assert_eq!(r.rejection.unwrap().reason, "rate_limited");
        let mut ended = false;
        for seq in 12..200 {
            // Heartbeats count too (one each).
            let m = if seq % 2 == 0 {
                progress(seq, false, &[])
            } else {
                v1::WorkerReport {
                    kind: Some(Kind::Heartbeat(v1::Heartbeat { seq })),
                }
            };
            if let Step::End(e) = s.on_message(m, now) {
                assert!(matches!(e, StreamError::Flood { limit: 10 }));
                ended = true;
                break;
            }
        }
        assert!(ended);
    }

    #[test]
    fn seq_u64_max_ends_the_stream_and_a_new_stream_goes_on() {
        let mut s = session();
        let now = Instant::now();
        let r = reply(s.on_message(progress(u64::MAX - 1, false, &[("a", 5, 1, false)]), now));
        assert_eq!(r.status, v1::AckStatus::Ok);
        // u64::MAX would wedge the stream: it ends, typed, and the message is not applied.
        for last in [
            progress(u64::MAX, false, &[("a", 5, 9, false)]),
            v1::WorkerReport {
                kind: Some(Kind::Heartbeat(v1::Heartbeat { seq: u64::MAX })),
            },
        ] {
            match s.on_message(last, now) {
                Step::End(e) => {
                    assert!(
                        matches!(e, StreamError::SeqExhausted { last } if last == u64::MAX - 1)
                    );
                    assert_eq!(e.to_status().code(), tonic::Code::OutOfRange);
                    assert_eq!(e.reason(), "seq_exhausted");
                }
                Step::Reply(r) => panic!("seq u64::MAX answered {r:?}"),
            }
        }
        assert_eq!(s.state_of("a").unwrap().generated_tokens, 1);
        // The shim's next stream (same identity) starts its seq space anew.
        let mut next = session();
        let r = reply(next.on_message(progress(1, true, &[("a", 5, 9, false)]), now));
        assert_eq!((r.status, r.seq), (v1::AckStatus::Ok, 1));
        assert!(!r.changes.is_empty());
        assert_eq!(next.state_of("a").unwrap().generated_tokens, 9);
    }

    #[test]
    fn tracked_requests_are_bounded() {
        let mut s = Session::new(
            hello(),
            Limits {
                max_tracked: 2,
                ..Limits::default()
            },
            Instant::now(),
        );
        let now = Instant::now();
        reply(s.on_message(
            progress(1, false, &[("a", 1, 1, true), ("b", 1, 1, false)]),
            now,
        ));
        // Finished a is dropped to make room for c.
        let r = reply(s.on_message(progress(2, false, &[("c", 1, 1, false)]), now));
        assert_eq!(r.status, v1::AckStatus::Ok);
        let r = reply(s.on_message(progress(3, false, &[("d", 1, 1, false)]), now));
        assert_eq!(r.rejection.unwrap().reason, "too_many_requests");
    }
}
