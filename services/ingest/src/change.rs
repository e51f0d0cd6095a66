//! The changes ingest derives from telemetry, before they become `TelemetryChange` messages.
//!
//! Kept as our own type (ids are `Arc<str>`, no prost) so the coalescing buffer can key and
//! merge them cheaply; [`Change::to_wire`] builds the message when a batch is sent.

use br_proto::v1;
use br_proto::v1::telemetry_change::Kind;
use br_proto::valid::{RequestId, ValidHello};

/// A request's cumulative state as one worker reported it: max() of the counts, sticky
/// `finished`. Merging is commutative, associative and idempotent, which is what makes
/// duplicates and reordering harmless.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cumulative {
    /// s_i; 0 = not known yet.
    pub prompt_tokens: u32,
    /// j, cumulative.
    pub generated_tokens: u32,
    /// Sticky.
    pub finished: bool,
    /// Reported without the gateway's id (telemetry `unkeyed`); sticky.
    pub unkeyed: bool,
}

impl Cumulative {
    /// Takes the max of each count and ORs `finished`; returns whether anything changed.
    pub fn merge(&mut self, other: Cumulative) -> bool {
        let before = *self;
        self.prompt_tokens = self.prompt_tokens.max(other.prompt_tokens);
        self.generated_tokens = self.generated_tokens.max(other.generated_tokens);
        self.finished |= other.finished;
        self.unkeyed |= other.unkeyed;
        before != *self
    }

    /// What the merge with `other` would give, without changing `self`.
    pub fn merged(self, other: Cumulative) -> Cumulative {
        let mut m = self;
        m.merge(other);
        m
    }

    /// The request's KV load in tokens (prompt + generated), without overflow.
    pub fn load(self) -> u64 {
        u64::from(self.prompt_tokens) + u64::from(self.generated_tokens)
    }
}

/// One change for the snapshot service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A worker's stream said Hello.
    Hello {
        worker_id: u32,
        incarnation: u64,
        capacity: u32,
        endpoint: String,
    },
    /// The latest cumulative state of one request.
    Progress {
        worker_id: u32,
        incarnation: u64,
        request_id: RequestId,
        state: Cumulative,
    },
    /// A full state: the worker holds exactly these requests.
    Sync {
        worker_id: u32,
        incarnation: u64,
        request_ids: Vec<RequestId>,
    },
    /// The worker's stream ended.
    Disconnected {
        worker_id: u32,
        incarnation: u64,
        at_unix_ms: u64,
    },
}

impl Change {
    /// The WorkerHello for a validated Hello.
    pub fn hello(h: &ValidHello) -> Change {
        Change::Hello {
            worker_id: h.worker_id,
            incarnation: h.incarnation,
            capacity: h.capacity,
            endpoint: h.endpoint.clone(),
        }
    }

    /// (worker_id, incarnation) the change is about.
    pub fn worker(&self) -> (u32, u64) {
        match self {
            Change::Hello {
                worker_id,
                incarnation,
                ..
            }
            | Change::Progress {
                worker_id,
                incarnation,
                ..
            }
            | Change::Sync {
                worker_id,
                incarnation,
                ..
            }
            | Change::Disconnected {
                worker_id,
                incarnation,
                ..
            } => (*worker_id, *incarnation),
        }
    }

    /// The wire message.
    pub fn to_wire(&self) -> v1::TelemetryChange {
        use v1::telemetry_change as tc;
        let kind = match self {
            Change::Hello {
                worker_id,
                incarnation,
                capacity,
                endpoint,
            } => Kind::WorkerHello(tc::WorkerHello {
                worker_id: *worker_id,
                incarnation: *incarnation,
                capacity: *capacity,
                endpoint: endpoint.clone(),
            }),
            Change::Progress {
                worker_id,
                incarnation,
                request_id,
                state,
            } => Kind::RequestProgress(tc::RequestProgress {
                worker_id: *worker_id,
                incarnation: *incarnation,
                request_id: request_id.as_str().to_owned(),
                prompt_tokens: state.prompt_tokens,
                generated_tokens: state.generated_tokens,
                finished: state.finished,
                unkeyed: state.unkeyed,
            }),
            Change::Sync {
                worker_id,
                incarnation,
                request_ids,
            } => Kind::WorkerSync(tc::WorkerSync {
                worker_id: *worker_id,
                incarnation: *incarnation,
                request_ids: request_ids.iter().map(|r| r.as_str().to_owned()).collect(),
            }),
            Change::Disconnected {
                worker_id,
                incarnation,
                at_unix_ms,
            } => Kind::WorkerDisconnected(tc::WorkerDisconnected {
                worker_id: *worker_id,
                incarnation: *incarnation,
                disconnected_at_unix_ms: *at_unix_ms,
            }),
        };
        v1::TelemetryChange { kind: Some(kind) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_is_max_and_sticky() {
        let mut c = Cumulative {
            prompt_tokens: 10,
            generated_tokens: 5,
            finished: false,
            unkeyed: false,
        };
        assert!(!c.merge(Cumulative {
            prompt_tokens: 0,
            generated_tokens: 3,
            finished: false,
            unkeyed: false,
        }));
        assert!(c.merge(Cumulative {
            prompt_tokens: 0,
            generated_tokens: 7,
            finished: true,
            unkeyed: false,
        }));
        assert_eq!(
            c,
            Cumulative {
                prompt_tokens: 10,
                generated_tokens: 7,
                finished: true,
                unkeyed: false,
            }
        );
        assert!(!c.merge(Cumulative::default()), "finished stays");
        assert_eq!(c.load(), 17);
    }

    #[test]
    fn unkeyed_is_sticky_and_reaches_the_wire() {
        let mut c = Cumulative {
            prompt_tokens: 10,
            unkeyed: true,
            ..Cumulative::default()
        };
        assert!(
            !c.merge(Cumulative::default()),
            "a later keyed-looking report changes nothing"
        );
        assert!(c.unkeyed);
        let change = Change::Progress {
            worker_id: 1,
            incarnation: 2,
            request_id: RequestId::new("cmpl-1").unwrap(),
            state: c,
        };
        let Some(Kind::RequestProgress(p)) = change.to_wire().kind else {
            panic!("a RequestProgress");
        };
        assert!(p.unkeyed);
    }
}
