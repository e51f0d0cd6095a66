//! The front ends: how gateways reach a group. Each turns its wire format into calls on the
//! group's task and answers from what the task replies; none holds placement state.
//!
//! - [`grpc`]: `balanceroute.v1.Decision` (Assign, Cancel), the reference edge.
//! - [`http`]: HTTP/JSON for gateways without gRPC (`--http-listen`), handed to the gRPC
//!   edge's service so both behave alike.
//! - [`ext_proc`]: Envoy's external processor as an endpoint picker (`--ext-proc-listen`).
//!
//! The layering runs one way: edges use the group, its task and the metrics; nothing below
//! them names an edge.

pub(crate) mod ext_proc;
pub(crate) mod grpc;
pub(crate) mod http;
