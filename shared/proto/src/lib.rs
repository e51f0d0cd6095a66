//! BalanceRoute's wire contracts and the validated domain types built from them.
//!
//! - [`v1`]: prost messages and tonic clients/servers generated from `proto/balanceroute/v1`
//!   (built without a system `protoc`). The `.proto` files are the specification.
//! - [`FILE_DESCRIPTOR_SET`]: the encoded descriptors, for tonic-reflection.
//! - [`valid`]: `TryFrom` conversions from the prost messages that arrive at a service into
//!   types whose invariants hold, with one [`ValidationError`] enum that maps to
//!   `tonic::Status::invalid_argument`. Wire types stay at the edge.
//! - [`defaults`]: the default addresses every binary listens on and dials, and the
//!   environment variables that change where it dials.

pub mod defaults;
pub mod fuzz;
pub mod valid;

pub use valid::{GroupId, RequestId, ValidationError};

/// Generated code for package `balanceroute.v1`.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod v1 {
    tonic::include_proto!("balanceroute.v1");
}

/// The one map from reject reasons to the `reason` label of the services' rejection counters
/// (`balanceroute_snapshot_rejected_total`, `balanceroute_decision_reserve_failures_total`).
/// It lives beside the enum so every service counts a reason under the same name.
impl v1::RejectReason {
    /// Every value, in wire order (for pre-creating counter series; a test checks it is
    /// complete).
    pub const ALL: [v1::RejectReason; 11] = [
        v1::RejectReason::Unspecified,
        v1::RejectReason::UnknownWorker,
        v1::RejectReason::WorkerFenced,
        v1::RejectReason::StaleIncarnation,
        v1::RejectReason::Duplicate,
        v1::RejectReason::WorkerFull,
        v1::RejectReason::UnknownRequest,
        v1::RejectReason::Invalid,
        v1::RejectReason::ConnectedElsewhere,
        v1::RejectReason::WorkerCordoned,
        v1::RejectReason::NotOwner,
    ];

    /// The metric label: the proto name without its `REJECT_REASON_` prefix, in lower case.
    /// `Unspecified` (an unset or unknown value from a peer) keeps its own label instead of
    /// being folded into `invalid`, so a peer that sends no reason is told apart from a change
    /// that failed validation.
    pub fn label(self) -> &'static str {
        match self {
            v1::RejectReason::Unspecified => "unspecified",
            v1::RejectReason::UnknownWorker => "unknown_worker",
            v1::RejectReason::WorkerFenced => "worker_fenced",
            v1::RejectReason::StaleIncarnation => "stale_incarnation",
            v1::RejectReason::Duplicate => "duplicate",
            v1::RejectReason::WorkerFull => "worker_full",
            v1::RejectReason::UnknownRequest => "unknown_request",
            v1::RejectReason::Invalid => "invalid",
            v1::RejectReason::ConnectedElsewhere => "connected_elsewhere",
            v1::RejectReason::WorkerCordoned => "worker_cordoned",
            v1::RejectReason::NotOwner => "not_owner",
        }
    }
}

/// The encoded `FileDescriptorSet` of every BalanceRoute proto (with imports and source info),
/// for `tonic_reflection::server::Builder::register_encoded_file_descriptor_set`.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/balanceroute_descriptor.bin"));

/// Full gRPC service names, as used by health checks and reflection.
pub mod service_names {
    /// `balanceroute.v1.Decision`
    pub const DECISION: &str = "balanceroute.v1.Decision";
    /// `balanceroute.v1.Telemetry`
    pub const TELEMETRY: &str = "balanceroute.v1.Telemetry";
    /// `balanceroute.v1.Snapshot`
    pub const SNAPSHOT: &str = "balanceroute.v1.Snapshot";
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn descriptor_set_lists_every_service() {
        let fds = prost_types::FileDescriptorSet::decode(FILE_DESCRIPTOR_SET)
            .expect("descriptor set decodes");
        let services: Vec<String> = fds
            .file
            .iter()
            .flat_map(|f| {
                let pkg = f.package().to_owned();
                f.service.iter().map(move |s| format!("{pkg}.{}", s.name()))
            })
            .collect();
        for name in [
            service_names::DECISION,
            service_names::TELEMETRY,
            service_names::SNAPSHOT,
        ] {
            assert!(services.iter().any(|s| s == name), "{name} missing");
        }
    }

    #[test]
    fn every_reject_reason_has_a_distinct_label_matching_its_proto_name() {
        // ALL lists every value the enum decodes (a value added to the proto must be added).
        let decodable: Vec<v1::RejectReason> = (0..64)
            .filter_map(|i| v1::RejectReason::try_from(i).ok())
            .collect();
        assert_eq!(decodable, v1::RejectReason::ALL.to_vec());
        let mut labels: Vec<&str> = v1::RejectReason::ALL.iter().map(|r| r.label()).collect();
        for (r, l) in v1::RejectReason::ALL.iter().zip(&labels) {
            // An independent derivation: the proto name, as Prometheus labels are spelled.
            let from_proto = r
                .as_str_name()
                .strip_prefix("REJECT_REASON_")
                .map(str::to_ascii_lowercase);
            assert_eq!(from_proto.as_deref(), Some(*l), "{r:?}");
        }
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), v1::RejectReason::ALL.len(), "{labels:?}");
    }

    #[test]
    fn generated_names_match_service_constants() {
        use tonic::server::NamedService;
        assert_eq!(
            <v1::decision_server::DecisionServer<Dummy> as NamedService>::NAME,
            service_names::DECISION
        );
    }

    struct Dummy;
    #[tonic::async_trait]
    impl v1::decision_server::Decision for Dummy {
        async fn assign(
            &self,
            _: tonic::Request<v1::AssignRequest>,
        ) -> Result<tonic::Response<v1::AssignResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("test"))
        }
        async fn cancel(
            &self,
            _: tonic::Request<v1::CancelRequest>,
        ) -> Result<tonic::Response<v1::CancelResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("test"))
        }
    }
}
