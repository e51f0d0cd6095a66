//! Trust for every BalanceRoute endpoint: mutual TLS with rotating certificates, SPIFFE-shaped
//! identities, and the one method × role authorisation table.
//!
//! * [`IdentityReader`]: reading `spiffe://<trust-domain>/br/<role>` (and
//!   `.../br/worker/<group>/<worker_id>`, `.../br/worker/<group>/<first>-<last>`) from a
//!   certificate's URI SAN.
//! * [`RoleMap`]: `--spiffe-role-map`, roles for Kubernetes service-account ids
//!   (`spiffe://<trust-domain>/ns/<namespace>/sa/<name>`, what csi-driver-spiffe issues).
//! * [`policy`]: which roles may call which gRPC method, and the tower layer that enforces it
//!   on every server (denials are PERMISSION_DENIED naming the role and the method).
//! * [`tls`]: certificates, keys and CA loaded from files and reloaded when they change; rustls
//!   server and client configs over them; a TLS acceptor for tonic servers and a connector for
//!   tonic channels.
//! * [`accept`]: the accept loop of every port: a bound on open connections, silent ones
//!   closed, accept errors backed off.
//! * [`address`]: the address a client dials, `http://` or `https://` alike under TLS.
//! * [`admin`]: the admin HTTP port over TLS: probes open, everything else for the admin role.
//! * [`TlsArgs`]: the `--tls-*` flags every binary takes, and the loopback-only default without
//!   them.

pub mod accept;
pub mod address;
pub mod admin;
mod args;
mod identity;
pub mod policy;
mod role;
mod rolemap;
pub mod tls;
mod worker_ids;

pub use args::{InsecureBind, TlsArgs};
pub use identity::{
    DEFAULT_TRUST_DOMAIN, Identity, IdentityError, IdentityReader, Role, WorkerIds, WorkerIdsError,
    WorkerSlot,
};
pub use policy::{AuthzLayer, DenyReason};
pub use rolemap::{Grant, RoleMap, RoleMapEntry, RoleMapError, service_account_id};
pub use tls::{TlsFiles, TlsMaterial};
