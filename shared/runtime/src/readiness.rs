//! Whether a service can do its job: the flag `/readyz` serves (see [`crate::admin`]) and gRPC
//! health follows (see [`crate::serve`]).

use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Whether the service can do its job (decision: can place a request; ingest: connected to
/// the snapshot service), and why not when it cannot. Cheap to clone; every clone sets and
/// reads the same flag. Starts not ready.
#[derive(Clone, Debug)]
pub struct Readiness {
    tx: Arc<watch::Sender<bool>>,
    /// Why the service is not ready (shown by `/readyz`); empty when it gave no reason.
    why_not: Arc<std::sync::Mutex<String>>,
}

impl Default for Readiness {
    fn default() -> Self {
        Self::new(false)
    }
}

impl Readiness {
    pub fn new(ready: bool) -> Self {
        Readiness {
            tx: Arc::new(watch::channel(ready).0),
            why_not: Arc::default(),
        }
    }

    /// Sets the flag (notifies subscribers only when it changes).
    pub fn set(&self, ready: bool) {
        self.set_why_not(String::new());
        self.tx
            .send_if_modified(|r| std::mem::replace(r, ready) != ready);
    }

    /// Not ready, for `reason` (what `/readyz` says). Notifies subscribers when the flag or
    /// the reason changes: a readiness made of others ([`all_of`]) re-reads their reasons only
    /// when notified, and a service that stays not ready for a new reason ("no σ yet", then "no
    /// live worker") must not leave the old one showing.
    pub fn set_not_ready(&self, reason: impl Into<String>) {
        let reason = reason.into();
        let reason_changed = {
            let mut why = self
                .why_not
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let changed = *why != reason;
            *why = reason;
            changed
        };
        self.tx
            .send_if_modified(|r| std::mem::replace(r, false) || reason_changed);
    }

    /// Why the service is not ready, if it said.
    pub fn why_not(&self) -> String {
        self.why_not
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set_why_not(&self, reason: String) {
        *self
            .why_not
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = reason;
    }

    pub fn is_ready(&self) -> bool {
        *self.tx.borrow()
    }

    /// A receiver that sees every change (e.g. to drive gRPC health from readiness).
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.tx.subscribe()
    }
}

/// Readiness that holds while every part's does: the all-in-one's `/readyz` over its
/// components. Not ready names each part that is not, with its reason
/// (`"decision: no live worker in group(s) g0"`). The returned flag follows the parts until
/// `stop` is cancelled.
pub fn all_of(parts: Vec<(&'static str, Readiness)>, stop: CancellationToken) -> Readiness {
    let combined = Readiness::default();
    let judge = {
        let combined = combined.clone();
        let parts = parts.clone();
        move || {
            let why: Vec<String> = parts
                .iter()
                .filter(|(_, r)| !r.is_ready())
                .map(|(name, r)| match r.why_not() {
                    w if w.is_empty() => format!("{name}: not ready"),
                    w => format!("{name}: {w}"),
                })
                .collect();
            if why.is_empty() {
                combined.set(true);
            } else {
                combined.set_not_ready(why.join("; "));
            }
        }
    };
    judge();
    let mut rxs: Vec<watch::Receiver<bool>> = parts.iter().map(|(_, r)| r.subscribe()).collect();
    tokio::spawn(async move {
        loop {
            // Any part changing re-judges all of them (a handful of flags).
            let changed =
                futures::future::select_all(rxs.iter_mut().map(|rx| Box::pin(rx.changed())));
            tokio::select! {
                (r, _, _) = changed => if r.is_err() { return },
                () = stop.cancelled() => return,
            }
            judge();
        }
    });
    combined
}
