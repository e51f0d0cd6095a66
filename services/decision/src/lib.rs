//! br-decision: the decision service of BalanceRoute (`balanceroute.v1.Decision`).
//!
//! A gateway calls `Assign` once per request whose prefill is done; the service answers with
//! the decode rank. Per served group, one task ([`task`]) owns the state ([`group`]): the σ
//! replica (from `Snapshot.Watch`, via `br_client::watch`), the pool, the policy (from
//! `br_core`), the requests by id, and its own reservations. Pooled policies (`br0`, `brh*`)
//! admit a batch per tick; baselines and `br0-bypass` route on arrival. Every assignment is
//! reserved in σ (one `Snapshot.Reserve` per tick) before the callers are answered.
//!
//! Design choices worth knowing:
//! * unknown groups are NOT_FOUND: `--groups` is the fixed list, so a typo or a hostile caller
//!   cannot make the service watch and hold state for arbitrary groups;
//! * while the snapshot service is away, decisions use the last σ plus this service's own
//!   reservations, are answered with `stale = true`, and are reserved when it is back;
//! * readiness (/readyz, gRPC health of `balanceroute.v1.Decision`) is "it can place a
//!   request": every group has a complete σ and one has a live worker; it stays true through a
//!   snapshot outage (the last σ counts), so the replica keeps answering.
//!
//! Modules: `config` (flags), `app` (wiring), `edge` (the front ends: gRPC handlers,
//! the same handlers as HTTP/JSON on `--http-listen`, the Envoy endpoint picker on
//! `--ext-proc-listen`), `task` and `group` (the per-group state), `upstream`
//! (Reserve/Release client), `cancel_ack` (Cancel's RELEASED waits for the acknowledged
//! Release), `live` (the live page on the admin port, `/live`), `metrics`, `error`. All are
//! private: the public surface is what the binary, br-all (which embeds the service) and the
//! tests call, re-exported here.

pub(crate) mod app;
pub(crate) mod cancel_ack;
pub(crate) mod config;
pub(crate) mod edge;
pub(crate) mod error;
pub(crate) mod group;
pub(crate) mod live;
pub(crate) mod metrics;
pub(crate) mod task;
pub(crate) mod upstream;

pub use app::{EXT_PROC_KEY, Embedding, Groups, Running, Upstream, start, start_embedded};
pub use config::{Args, DecisionConfig};
pub use error::DecisionError;
pub use upstream::SnapshotOps;
