//! The live workers: one entry per open, Hello'd stream, keyed by (group, worker id) whatever
//! the incarnation. Used to refuse a second stream for a worker that already has a live one (two
//! shims with the same `--worker-id`, or a restarted shim whose old connection lingers: the
//! first is never evicted silently; a dead connection is closed by HTTP/2 keepalive, which
//! frees the slot), to re-send every live worker's Hello when the snapshot link comes back, to
//! ask workers for a full state (the stream picks the flag up on its next ack), and to end a
//! worker's stream when the snapshot service refused its changes ([`Registry::refuse`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use br_proto::v1;
use br_proto::valid::{GroupId, ValidHello};
use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use tokio::sync::watch;

/// (group, worker_id, incarnation).
pub type WorkerKey = (GroupId, u32, u64);

/// The key of a Hello.
pub fn key_of(h: &ValidHello) -> WorkerKey {
    (h.group.clone(), h.worker_id, h.incarnation)
}

fn slot(key: &WorkerKey) -> (GroupId, u32) {
    (key.0.clone(), key.1)
}

/// Why the snapshot service refused a worker's change (from an ApplyAck).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub reason: v1::RejectReason,
    pub detail: String,
}

#[derive(Debug)]
struct Live {
    stream_id: u64,
    hello: ValidHello,
    full_state: Arc<AtomicBool>,
    /// Set once, when the stream must end because the snapshot service refused it.
    refused: watch::Sender<Option<Refusal>>,
}

/// Cheap to clone; every clone is the same registry.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    map: Arc<DashMap<(GroupId, u32), Live>>,
    next_stream: Arc<AtomicU64>,
}

/// A registered stream: its id, its "send a full state" flag, and the refusal that ends it.
#[derive(Debug, Clone)]
pub struct Registration {
    pub key: WorkerKey,
    pub stream_id: u64,
    pub full_state: Arc<AtomicBool>,
    pub refused: watch::Receiver<Option<Refusal>>,
}

impl Registry {
    /// Registers a stream for `hello`'s worker; `Err(incarnation)` with the live stream's
    /// incarnation if another stream holds that worker (of any incarnation).
    pub fn register(&self, hello: &ValidHello) -> Result<Registration, u64> {
        let key = key_of(hello);
        match self.map.entry((key.0.clone(), key.1)) {
            Entry::Occupied(live) => Err(live.get().hello.incarnation),
            Entry::Vacant(v) => {
                let stream_id = self.next_stream.fetch_add(1, Ordering::Relaxed) + 1;
                let full_state = Arc::new(AtomicBool::new(false));
                let (refused, refused_rx) = watch::channel(None);
                v.insert(Live {
                    stream_id,
                    hello: hello.clone(),
                    full_state: full_state.clone(),
                    refused,
                });
                Ok(Registration {
                    key,
                    stream_id,
                    full_state,
                    refused: refused_rx,
                })
            }
        }
    }

    /// Records a repeated Hello's new capacity or endpoint.
    pub fn update_hello(&self, reg: &Registration, hello: &ValidHello) {
        if let Some(mut live) = self.map.get_mut(&slot(&reg.key))
            && live.stream_id == reg.stream_id
        {
            live.hello = hello.clone();
        }
    }

    /// Removes the stream's entry (if it is still this stream's).
    pub fn unregister(&self, reg: &Registration) {
        self.map
            .remove_if(&slot(&reg.key), |_, live| live.stream_id == reg.stream_id);
    }

    /// Asks every live worker for a full state.
    pub fn request_full_state_all(&self) {
        for live in self.map.iter() {
            live.full_state.store(true, Ordering::Relaxed);
        }
    }

    /// Asks one worker for a full state (if it is live).
    pub fn request_full_state(&self, key: &WorkerKey) {
        if let Some(live) = self.map.get(&slot(key))
            && live.hello.incarnation == key.2
        {
            live.full_state.store(true, Ordering::Relaxed);
        }
    }

    /// Ends the live stream of `key`'s worker, if it is that incarnation and not already
    /// ending: the snapshot service refused its change. Returns whether it did (a refusal of
    /// an incarnation no stream here carries any more, e.g. a late disconnect, ends nothing).
    pub fn refuse(&self, key: &WorkerKey, refusal: Refusal) -> bool {
        let Some(live) = self.map.get(&slot(key)) else {
            return false;
        };
        if live.hello.incarnation != key.2 {
            return false;
        }
        live.refused.send_if_modified(|r| {
            if r.is_some() {
                return false;
            }
            *r = Some(refusal);
            true
        })
    }

    /// Every live worker's Hello.
    pub fn live_hellos(&self) -> Vec<ValidHello> {
        self.map.iter().map(|l| l.hello.clone()).collect()
    }

    /// Live streams.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn hello(w: u32) -> ValidHello {
        ValidHello {
            group: GroupId::new("g").unwrap(),
            worker_id: w,
            incarnation: 5,
            capacity: 1,
            endpoint: String::new(),
        }
    }

    #[test]
    fn one_stream_per_identity_and_flags() {
        let r = Registry::default();
        let a = r.register(&hello(1)).unwrap();
        assert_eq!(r.register(&hello(1)).err(), Some(5), "same identity twice");
        // another incarnation of a live worker (a second shim with the same --worker-id, or a
        // restart whose old stream lingers) is refused too, naming the live incarnation
        let mut restarted = hello(1);
        restarted.incarnation = 6;
        assert_eq!(r.register(&restarted).err(), Some(5));
        // and a full-state request for the refused incarnation does not flag the live one
        r.request_full_state(&key_of(&restarted));
        assert!(!a.full_state.load(Ordering::Relaxed));
        let b = r.register(&hello(2)).unwrap();
        r.request_full_state_all();
        assert!(a.full_state.swap(false, Ordering::Relaxed));
        assert!(b.full_state.load(Ordering::Relaxed));
        r.request_full_state(&a.key);
        assert!(a.full_state.load(Ordering::Relaxed));
        assert_eq!(r.live_hellos().len(), 2);
        // a refusal ends the live stream of that incarnation, once; another incarnation's
        // refusal (a late one) ends nothing
        let why = |d: &str| Refusal {
            reason: v1::RejectReason::StaleIncarnation,
            detail: d.into(),
        };
        assert!(!r.refuse(&key_of(&restarted), why("late")));
        assert!(a.refused.borrow().is_none());
        assert!(r.refuse(&a.key, why("first")));
        assert!(!r.refuse(&a.key, why("second")), "the first reason is kept");
        assert_eq!(a.refused.borrow().as_ref().unwrap().detail, "first");
        assert!(b.refused.borrow().is_none());
        r.unregister(&a);
        assert_eq!(r.len(), 1);
        let a2 = r.register(&hello(1)).unwrap();
        r.unregister(&a); // a stale registration does not remove the new stream
        assert_eq!(r.len(), 2);
        r.unregister(&a2);
        r.unregister(&b);
        assert!(r.is_empty());
    }
}
