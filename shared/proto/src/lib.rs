//! BalanceRoute's wire contracts and the validated domain types built from them.
//!
//! - [`v1`]: prost messages and tonic clients/servers generated from `proto/balanceroute/v1`
//!   (built without a system `protoc`). The `.proto` files are the specification.
//! - [`FILE_DESCRIPTOR_SET`]: the encoded descriptors, for tonic-reflection.
//! - [`valid`]: `TryFrom` conversions from the prost messages that arrive at a service into
//!   types whose invariants hold, with one [`ValidationError`] enum that maps to
//!   `tonic::Status::invalid_argument`. Wire types stay at the edge.

pub mod valid;

pub use valid::{GroupId, RequestId, ValidationError};

/// Generated code for package `balanceroute.v1`.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod v1 {
    tonic::include_proto!("balanceroute.v1");
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
