//! Client-side building blocks of BalanceRoute, shared by gateways, shims and the services.
//!
//! * [`watch`]: follows `Snapshot.Watch` into a `br_sigma::Sigma` replica, resubscribing with backoff on gaps, resets and errors.
//! * [`reporter`]: the telemetry reporter a shim (or a gateway) uses to stream progress.
//! * [`assign`]: the gateway's `Assign`/`Cancel` client with deadlines and id-keeping retries.
//!
//! One crate, not one per user (the shim reports, decision watches, gateways assign): the
//! three modules share no code, but every user pays for the same stack whichever it takes
//! (tonic, br-proto, br-trust, br-backoff, br-trace); only `watch` adds br-sigma, a small
//! pure crate. Three crates would triple the manifests and remove no heavy dependency from
//! any user. Split when one does: a gateway that must not build br-sigma, say.

pub mod assign;
pub mod reporter;
pub mod watch;
