//! `br-emu`: an emulated lockstep data-parallel decode engine with an OpenAI-compatible API
//! ([`engine`]), and a minimal gateway that replays a trace through BalanceRoute ([`load`]).
#![forbid(unsafe_code)]

pub mod engine;
pub mod load;
