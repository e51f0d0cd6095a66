//! Builders for [`v1::Change`]s, so callers need not spell out the oneof.

use br_proto::v1;
use br_proto::v1::change::{self as c, Kind};

use crate::Hints;

fn wrap(kind: Kind) -> v1::Change {
    v1::Change { kind: Some(kind) }
}

pub fn worker_up(worker_id: u32, incarnation: u64, capacity: u32, endpoint: &str) -> v1::Change {
    worker_up_via(worker_id, incarnation, capacity, endpoint, "")
}

/// A WorkerUp whose Hello arrived through the ingest replica `carrier`.
pub fn worker_up_via(
    worker_id: u32,
    incarnation: u64,
    capacity: u32,
    endpoint: &str,
    carrier: &str,
) -> v1::Change {
    wrap(Kind::WorkerUp(c::WorkerUp {
        worker_id,
        incarnation,
        capacity,
        endpoint: endpoint.to_owned(),
        carrier: carrier.to_owned(),
    }))
}

pub fn worker_suspect(worker_id: u32, incarnation: u64) -> v1::Change {
    wrap(Kind::WorkerSuspect(c::WorkerSuspect {
        worker_id,
        incarnation,
    }))
}

pub fn worker_fenced(worker_id: u32, incarnation: u64) -> v1::Change {
    wrap(Kind::WorkerFenced(c::WorkerFenced {
        worker_id,
        incarnation,
    }))
}

pub fn worker_cordon(worker_id: u32, cordoned: bool) -> v1::Change {
    wrap(Kind::WorkerCordon(c::WorkerCordon {
        worker_id,
        cordoned,
    }))
}

/// A reservation without hints ([`request_reserved_hinted`]).
pub fn request_reserved(
    request_id: &str,
    worker_id: u32,
    incarnation: u64,
    prompt_tokens: u32,
    prompt_hash: Option<u64>,
    max_tokens: Option<u32>,
) -> v1::Change {
    request_reserved_hinted(
        request_id,
        worker_id,
        incarnation,
        prompt_tokens,
        prompt_hash,
        max_tokens,
        Hints::default(),
    )
}

/// A reservation that carries the gateway's hints on its output.
pub fn request_reserved_hinted(
    request_id: &str,
    worker_id: u32,
    incarnation: u64,
    prompt_tokens: u32,
    prompt_hash: Option<u64>,
    max_tokens: Option<u32>,
    hints: Hints,
) -> v1::Change {
    wrap(Kind::RequestReserved(c::RequestReserved {
        request_id: request_id.to_owned(),
        worker_id,
        incarnation,
        prompt_tokens,
        prompt_hash,
        max_tokens,
        expected_output_tokens: hints.expected_output,
        request_class_id: hints.class,
    }))
}

pub fn request_progress(
    request_id: &str,
    worker_id: u32,
    incarnation: u64,
    prompt_tokens: u32,
    generated_tokens: u32,
) -> v1::Change {
    wrap(Kind::RequestProgress(c::RequestProgress {
        request_id: request_id.to_owned(),
        worker_id,
        incarnation,
        prompt_tokens,
        generated_tokens,
    }))
}

pub fn request_finished(request_id: &str, generated_tokens: u32) -> v1::Change {
    wrap(Kind::RequestFinished(c::RequestFinished {
        request_id: request_id.to_owned(),
        generated_tokens,
    }))
}

pub fn request_expired(request_id: &str) -> v1::Change {
    wrap(Kind::RequestExpired(c::RequestExpired {
        request_id: request_id.to_owned(),
    }))
}

pub fn request_released(request_id: &str) -> v1::Change {
    wrap(Kind::RequestReleased(c::RequestReleased {
        request_id: request_id.to_owned(),
    }))
}
