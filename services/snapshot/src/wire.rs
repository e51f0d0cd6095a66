//! The edge between the service's domain types and the `balanceroute.v1` messages: what the
//! gRPC handlers parse requests into and build answers from. Nothing behind it (the writer,
//! the group) builds or parses a message. σ's own vocabulary (`Change`, `Delta`,
//! `ClusterSnapshot`, the reason enums) is br-sigma's and is used as it is: replicas apply the
//! very deltas the writer committed.

use br_proto::v1;
use br_proto::valid::ValidTelemetryChange;

use crate::group::{Applied, Event, Reject, Released, Reserved};

/// An Apply batch's changes after validation, each with its index in the batch.
#[derive(Debug)]
pub struct Changes {
    /// For the writer.
    pub valid: Vec<(usize, ValidTelemetryChange)>,
    /// Rejected here as INVALID.
    pub invalid: Vec<(usize, Reject)>,
}

/// Validates each change of an Apply batch on its own, so one bad change is rejected by its
/// index and the rest still apply.
pub fn telemetry_changes(changes: Vec<v1::TelemetryChange>) -> Changes {
    let mut valid = Vec::with_capacity(changes.len());
    let mut invalid = Vec::new();
    for (index, c) in changes.into_iter().enumerate() {
        match ValidTelemetryChange::try_from(c) {
            Ok(c) => valid.push((index, c)),
            Err(e) => invalid.push((index, Reject::invalid(e.to_string()))),
        }
    }
    Changes { valid, invalid }
}

/// The ack of one Apply batch: the changes rejected at the edge and by the group, by index.
pub fn apply_ack(batch_seq: u64, invalid: Vec<(usize, Reject)>, applied: Applied) -> v1::ApplyAck {
    let mut rejected: Vec<(usize, Reject)> = invalid;
    rejected.extend(applied.rejected);
    rejected.sort_by_key(|(index, _)| *index);
    v1::ApplyAck {
        batch_seq,
        epoch: applied.epoch,
        version: applied.version,
        rejected: rejected
            .into_iter()
            .map(|(index, r)| v1::ChangeRejection {
                index: u32::try_from(index).unwrap_or(u32::MAX),
                reason: r.reason as i32,
                detail: r.detail,
            })
            .collect(),
    }
}

pub fn reserve_response(r: Reserved) -> v1::ReserveResponse {
    v1::ReserveResponse {
        epoch: r.epoch,
        version: r.version,
        accepted: r.accepted.iter().map(ToString::to_string).collect(),
        rejected: r
            .rejected
            .into_iter()
            .map(|(id, rej)| v1::ReservationRejection {
                request_id: id.to_string(),
                reason: rej.reason as i32,
                detail: rej.detail,
            })
            .collect(),
    }
}

pub fn release_response(r: Released) -> v1::ReleaseResponse {
    v1::ReleaseResponse {
        version: r.version,
        released: r.released,
    }
}

/// What Get answers for a group the service does not hold: an empty σ at version 0.
pub fn empty_snapshot(group: &str, epoch: u64) -> v1::ClusterSnapshot {
    v1::ClusterSnapshot {
        group: group.to_owned(),
        epoch,
        ..Default::default()
    }
}

/// One event of a watcher's queue as its Watch stream sends it.
pub fn watch_event(ev: &Event) -> v1::WatchEvent {
    use v1::watch_event::Kind;
    let kind = match ev {
        Event::Snapshot(s) => Kind::Snapshot(v1::ClusterSnapshot::clone(s)),
        Event::Delta(d) => Kind::Delta(v1::watch_event::Delta::clone(d)),
        Event::Progress { epoch, version } => Kind::Progress(v1::watch_event::ProgressMark {
            epoch: *epoch,
            version: *version,
        }),
        Event::Reset {
            reason,
            epoch,
            detail,
        } => Kind::Reset(v1::watch_event::Reset {
            reason: *reason as i32,
            epoch: *epoch,
            detail: detail.to_string(),
        }),
    };
    v1::WatchEvent { kind: Some(kind) }
}
