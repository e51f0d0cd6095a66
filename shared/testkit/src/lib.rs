//! BalanceRoute's test kit: one of each thing the tests need, so that tests agree on what a
//! fake server does and on how long "never" is.
//!
//! - [`eventually`], [`eventually_some`] and [`within`]: every wait is bounded and a
//!   timeout panics naming what never happened. No test sleeps to synchronise.
//! - [`net`]: servers bind `127.0.0.1:0` and report the address they got; [`net::ReservedPort`]
//!   holds a port that refuses connections until a test starts listening on it.
//! - [`FakeSnapshot`] and [`FakeIngest`]: in-process gRPC fakes of
//!   the Snapshot and Telemetry services that record what they receive and whose behaviour a
//!   test sets (scripted Watch streams, Apply acks and stalls, full-state requests, killed
//!   streams, unary handlers).
//! - [`apply`]: one Apply stream to a real snapshot service, and telemetry change builders.
//! - [`http`] and [`prom`]: an HTTP GET on reqwest, and a Prometheus text-format reader that
//!   parses names, labels and values, with the metric contract (`deploy/metrics-contract.txt`).
//! - [`FaultProxy`]: a TCP proxy that freezes (half-open) or cuts the connections
//!   through it, for connection faults between real processes.
//!
//! It stands on no service: a service's own test support (br-snapshot's `test_util`, feature
//! `test-util`) starts the real thing.
//!
//! A dev-dependency only (`publish = false`): panicking is how it reports.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

pub mod apply;
mod fake_ingest;
mod fake_snapshot;
pub mod http;
pub mod net;
pub mod prom;
mod proxy;
mod wait;

pub use fake_ingest::FakeIngest;
pub use fake_snapshot::FakeSnapshot;
pub use net::{ReservedPort, Served};
pub use prom::Metrics;
pub use proxy::FaultProxy;
pub use wait::{eventually, eventually_or, eventually_some, within};

/// How long a test waits for something that should happen "soon" before calling it a hang.
/// Generous on purpose: it turns a hang into a failure on a busy 2-core machine, it is not a
/// performance assertion.
pub const PATIENCE: Duration = Duration::from_secs(20);
