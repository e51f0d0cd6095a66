//! Which request ids live streams hold, process-wide: a stream claims its request's
//! (group, id) when its headers arrive and gives it back when it ends, so a second stream
//! with the same id is refused while the first lives.
//!
//! Why: the id is the gateway's (Envoy keeps a client's own `x-request-id`), Assign is
//! idempotent by it, and a stream that ends before a response releases its reservation by
//! it. Two streams sharing an id would share one reservation, and the one that gave up would
//! release the other's. Claims make a stream's id its own for as long as it lives; a client
//! that retries once its first stream has ended reuses the id as before.

use std::sync::{Arc, Mutex, PoisonError};

use rustc_hash::FxHashSet;

/// Cheap to clone; every clone is the same set.
#[derive(Debug, Clone, Default)]
pub(super) struct Claims {
    held: Arc<Mutex<FxHashSet<(String, String)>>>,
}

/// One stream's claim on its request id; given back on drop.
#[derive(Debug)]
pub(super) struct Claim {
    claims: Claims,
    key: (String, String),
}

impl Claims {
    /// Claims `request_id` in `group`; `None` while another stream holds it.
    pub(super) fn claim(&self, group: &str, request_id: &str) -> Option<Claim> {
        let key = (group.to_owned(), request_id.to_owned());
        // (held for one insert or remove: a panic elsewhere cannot leave it half-updated)
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.insert(key.clone()).then(|| Claim {
            claims: self.clone(),
            key,
        })
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.claims
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.key);
    }
}
