//! The fuzzing harness for everything a peer can send us: each [`Target`] decodes arbitrary
//! bytes as one wire message and runs its validator. The proptest suite that CI runs
//! (`tests/fuzz.rs`) and the cargo-fuzz targets (`fuzz/`, `make fuzz`) both drive
//! [`decode_and_validate`], so what one finds the other replays.
//!
//! What must hold for any input: no panic, and a message that validates still validates after
//! a re-encode (the services forward what they accepted, e.g. ingest to the snapshot service).

use prost::Message;

use crate::v1;
use crate::valid::{
    ValidAssign, ValidCancel, ValidRelease, ValidReport, ValidReserve, ValidTelemetryChange,
    ValidWatch, ValidationError,
};

/// A message a peer sends and we decode and validate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// `Decision.Assign`, from a gateway.
    Assign,
    /// `Decision.Cancel`, from a gateway.
    Cancel,
    /// `Telemetry.Report`'s messages, from a worker's shim.
    WorkerReport,
    /// `Snapshot.Watch`, from decision.
    Watch,
    /// `Snapshot.Reserve`, from decision.
    Reserve,
    /// `Snapshot.Release`, from decision.
    Release,
    /// `Snapshot.Apply`'s batches, from ingest: the batch's group and every change.
    ChangeBatch,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Assign,
        Target::Cancel,
        Target::WorkerReport,
        Target::Watch,
        Target::Reserve,
        Target::Release,
        Target::ChangeBatch,
    ];

    /// The target named `name` (its variant name in snake case, e.g. `worker_report`).
    pub fn from_name(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Target::Assign => "assign",
            Target::Cancel => "cancel",
            Target::WorkerReport => "worker_report",
            Target::Watch => "watch",
            Target::Reserve => "reserve",
            Target::Release => "release",
            Target::ChangeBatch => "change_batch",
        }
    }

    /// Valid messages of this kind, encoded: where mutation starts.
    pub fn seeds(self) -> Vec<Vec<u8>> {
        let progress = |id: &str, generated: u32, finished: bool| v1::RequestProgress {
            request_id: id.into(),
            prompt_tokens: 10,
            generated_tokens: generated,
            finished,
            unkeyed: false,
        };
        let reservation = |id: &str| v1::Reservation {
            request_id: id.into(),
            worker_id: 1,
            incarnation: 7,
            prompt_tokens: 5,
            prompt_hash: Some(9),
            max_tokens: Some(64),
            queue_if_full: false,
            expected_output_tokens: Some(32),
            request_class_id: Some(0x8594_4171_f739_67e8),
        };
        match self {
            Target::Assign => vec![
                v1::AssignRequest {
                    group: "g0".into(),
                    request_id: "req-1".into(),
                    prompt_tokens: 100,
                    prompt_hash: Some(42),
                    max_tokens: Some(1024),
                    expected_output_tokens: Some(300),
                    request_class: Some("chat/tools".into()),
                }
                .encode_to_vec(),
            ],
            Target::Cancel => vec![
                v1::CancelRequest {
                    group: "g0".into(),
                    request_id: "req-1".into(),
                }
                .encode_to_vec(),
            ],
            Target::WorkerReport => {
                use v1::worker_report::Kind;
                [
                    Kind::Hello(v1::Hello {
                        group: "g0".into(),
                        worker_id: 3,
                        incarnation: 0xdead_beef,
                        capacity: 256,
                        endpoint: "http://127.0.0.1:8000".into(),
                    }),
                    Kind::Progress(v1::Progress {
                        seq: 2,
                        updates: vec![progress("a", 1, false), progress("b", 7, true)],
                        full_state: true,
                        traceparent: String::new(),
                        tracestate: String::new(),
                    }),
                    Kind::Heartbeat(v1::Heartbeat { seq: 3 }),
                ]
                .into_iter()
                .map(|k| v1::WorkerReport { kind: Some(k) }.encode_to_vec())
                .collect()
            }
            Target::Watch => vec![
                v1::WatchRequest {
                    group: "g0".into(),
                    epoch: 5,
                    last_version: 9,
                }
                .encode_to_vec(),
            ],
            Target::Reserve => vec![
                v1::ReserveRequest {
                    group: "g0".into(),
                    reservations: vec![reservation("a"), reservation("b")],
                }
                .encode_to_vec(),
            ],
            Target::Release => vec![
                v1::ReleaseRequest {
                    group: "g0".into(),
                    request_ids: vec!["a".into(), "b".into()],
                }
                .encode_to_vec(),
            ],
            Target::ChangeBatch => {
                use v1::telemetry_change::{
                    Kind, RequestProgress, WorkerDisconnected, WorkerHello,
                };
                let changes = vec![
                    Kind::WorkerHello(WorkerHello {
                        worker_id: 1,
                        incarnation: 7,
                        capacity: 8,
                        endpoint: "http://127.0.0.1:8001".into(),
                    }),
                    Kind::RequestProgress(RequestProgress {
                        worker_id: 1,
                        incarnation: 7,
                        request_id: "a".into(),
                        prompt_tokens: 10,
                        generated_tokens: 3,
                        finished: false,
                        unkeyed: false,
                    }),
                    Kind::WorkerDisconnected(WorkerDisconnected {
                        worker_id: 1,
                        incarnation: 7,
                        disconnected_at_unix_ms: 1_700_000_000_000,
                    }),
                ];
                vec![
                    v1::ChangeBatch {
                        batch_seq: 1,
                        group: "g0".into(),
                        changes: changes
                            .into_iter()
                            .map(|k| v1::TelemetryChange { kind: Some(k) })
                            .collect(),
                        ..Default::default()
                    }
                    .encode_to_vec(),
                ]
            }
        }
    }
}

/// What became of one input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Not a message of this kind (prost refused the bytes).
    NotDecoded,
    /// Decoded, and refused by the validator with this reason (the metric label).
    Invalid(&'static str),
    /// Decoded and valid.
    Valid,
}

/// Decodes `bytes` as `target`'s message and validates it. Panics only if an invariant of the
/// harness breaks (a valid message that no longer validates after a re-encode): a finding.
pub fn decode_and_validate(target: Target, bytes: &[u8]) -> Outcome {
    match target {
        Target::Assign => check::<v1::AssignRequest, _>(bytes, ValidAssign::try_from),
        Target::Cancel => check::<v1::CancelRequest, _>(bytes, ValidCancel::try_from),
        Target::WorkerReport => check::<v1::WorkerReport, _>(bytes, ValidReport::try_from),
        Target::Watch => check::<v1::WatchRequest, _>(bytes, ValidWatch::try_from),
        Target::Reserve => check::<v1::ReserveRequest, _>(bytes, ValidReserve::try_from),
        Target::Release => check::<v1::ReleaseRequest, _>(bytes, ValidRelease::try_from),
        Target::ChangeBatch => check::<v1::ChangeBatch, _>(bytes, valid_batch),
    }
}

/// A `ChangeBatch` as br-snapshot's Apply takes it: its group, then each change.
fn valid_batch(b: v1::ChangeBatch) -> Result<(), ValidationError> {
    crate::GroupId::new(&b.group)?;
    for c in b.changes {
        ValidTelemetryChange::try_from(c)?;
    }
    Ok(())
}

fn check<M, V>(bytes: &[u8], validate: impl Fn(M) -> Result<V, ValidationError>) -> Outcome
where
    M: Message + Default + Clone + std::fmt::Debug,
{
    let Ok(m) = M::decode(bytes) else {
        return Outcome::NotDecoded;
    };
    match validate(m.clone()) {
        Err(e) => Outcome::Invalid(e.reason_label()),
        Ok(_) => {
            let again = M::decode(m.encode_to_vec().as_slice());
            assert!(
                again.as_ref().is_ok_and(|a| validate(a.clone()).is_ok()),
                "a valid {} no longer validates after a re-encode: {again:?}",
                std::any::type_name::<M>()
            );
            Outcome::Valid
        }
    }
}
