//! Client-side building blocks of BalanceRoute, shared by gateways, shims and the services.
//!
//! * [`sigma`]: a replica of σ for one group, built from a snapshot and moved forward only by
//!   in-order deltas; also the snapshot service's own store (one implementation of "apply a
//!   change", so writer and replicas cannot disagree). Exposes a `br_core::ClusterState`.
//! * [`watch`]: follows `Snapshot.Watch`, resubscribing with backoff on gaps, resets and errors.
//! * [`reporter`]: the telemetry reporter a shim (or a gateway) uses to stream progress.
//! * [`assign`]: the gateway's `Assign`/`Cancel` client with deadlines and id-keeping retries.

pub mod assign;
pub mod reporter;
pub mod sigma;
pub mod watch;
