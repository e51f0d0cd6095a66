//! `br-sim`: the BalanceRoute digital twin.
//!
//! Replays request traces through the routing policies of `br-core` under the lockstep
//! step-time model `T = a·max_g L_g + b`, and reports imbalance, throughput and latency.
//!
//! Modules:
//! - [`trace`]: the request type and loaders for the public trace formats;
//! - [`synth`]: seeded synthetic stand-ins for the paper's two workloads;
//! - [`hints`]: clients' expected output lengths made from the true ones (`--hint-error`);
//! - [`classes`]: request classes made from the true output lengths (`--classes`);
//! - [`calibrate`]: least-squares fit of the step-time model from engine samples;
//! - [`report`]: the JSON report and the printed table;
//! - `plot`: SVG figures (per-worker load over steps, gain and imbalance against G);
//! - [`cli`]: the command line.

mod app;
pub mod calibrate;
pub mod classes;
pub mod cli;
mod engine;
pub mod hints;
mod plot;
pub mod report;
mod spec;
pub mod synth;
pub mod trace;

pub use app::execute;
