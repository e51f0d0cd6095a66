//! Client-side building blocks of BalanceRoute, shared by gateways, shims and the services.
//!
//! * [`watch`]: follows `Snapshot.Watch` into a `br_sigma::Sigma` replica, resubscribing with backoff on gaps, resets and errors.
//! * [`reporter`]: the telemetry reporter a shim (or a gateway) uses to stream progress.
//! * [`assign`]: the gateway's `Assign`/`Cancel` client with deadlines and id-keeping retries.

pub mod assign;
pub mod reporter;
pub mod watch;
