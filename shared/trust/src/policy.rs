//! Who may call what: the one method × role table, and the tower layer every gRPC server puts
//! in front of its routes to enforce it.
//!
//! The layer reads the peer's certificate from the connection (tonic puts the TLS connection's
//! `TlsConnectInfo` into each request's extensions), derives its [`Identity`], checks the
//! table, and either answers PERMISSION_DENIED itself (naming the role and the method; the
//! handler never runs) or passes the request on with the `Identity` in its extensions, so a
//! handler can check what the table cannot (a worker may report only for its own group and id:
//! see [`Identity::worker`]). On a plaintext server (loopback only, see `tls::Plaintext`) the
//! layer is not installed.

use std::sync::Arc;
use std::task::{Context, Poll};

use br_proto::service_names::{DECISION, SNAPSHOT, TELEMETRY};
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::identity::{Identity, IdentityReader, Role};

/// Why a call was refused (also the metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DenyReason {
    /// The connection carried no client certificate (cannot happen with our acceptor, which
    /// requires one; kept so a misconfigured server fails closed).
    NoCertificate,
    /// The certificate has no (or no unambiguous) identity of our trust domain.
    NoIdentity,
    /// The identity's role may not call this method.
    RoleNotAllowed,
    /// The method is not one this table knows.
    UnknownMethod,
}

impl DenyReason {
    pub fn label(self) -> &'static str {
        match self {
            DenyReason::NoCertificate => "no_certificate",
            DenyReason::NoIdentity => "no_identity",
            DenyReason::RoleNotAllowed => "role_not_allowed",
            DenyReason::UnknownMethod => "unknown_method",
        }
    }
}

/// Envoy's external-processing service, which br-decision serves on `--ext-proc-listen`.
pub const EXT_PROC: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// Which roles may call a gRPC method, by its path (`/package.Service/Method`). `None`: the
/// method is unknown to the table and every call is denied (fail closed: a new RPC must be
/// added here before anyone can call it).
pub fn allowed_roles(path: &str) -> Option<&'static [Role]> {
    const ANY: &[Role] = &Role::ALL;
    let (service, method) = path.strip_prefix('/')?.split_once('/')?;
    let roles: &'static [Role] = match (service, method) {
        (s, "Report") if s == TELEMETRY => &[Role::Worker],
        (s, "Apply") if s == SNAPSHOT => &[Role::Ingest],
        (s, "Reserve" | "ReserveStream" | "Release") if s == SNAPSHOT => &[Role::Decision],
        (s, "Watch" | "Get") if s == SNAPSHOT => &[Role::Decision, Role::Admin],
        (s, "ListGroups" | "SetCordon") if s == SNAPSHOT => &[Role::Admin],
        (s, "Assign" | "Cancel") if s == DECISION => &[Role::Gateway, Role::Admin],
        // br-decision's Envoy endpoint picker (`--ext-proc-listen`): an Assign per HTTP
        // request, so the roles that may call Assign; Envoy presents the gateway certificate.
        (EXT_PROC, "Process") => &[Role::Gateway, Role::Admin],
        ("grpc.health.v1.Health", _) => ANY,
        ("grpc.reflection.v1.ServerReflection", _) => ANY,
        ("grpc.reflection.v1alpha.ServerReflection", _) => ANY,
        _ => return None,
    };
    Some(roles)
}

/// Checks one call; `Ok` carries the caller's identity.
pub fn authorize(
    path: &str,
    peer_cert: Option<&[u8]>,
    reader: &IdentityReader,
) -> Result<Identity, (DenyReason, String)> {
    let Some(der) = peer_cert else {
        return Err((
            DenyReason::NoCertificate,
            format!("{path} needs a client certificate"),
        ));
    };
    let identity = reader
        .read_cert_der(der)
        .map_err(|e| (DenyReason::NoIdentity, format!("{path}: {e}")))?;
    let Some(roles) = allowed_roles(path) else {
        return Err((
            DenyReason::UnknownMethod,
            format!("{path} is not a method this server authorises"),
        ));
    };
    if !roles.contains(&identity.role) {
        let allowed: Vec<&str> = roles.iter().map(|r| r.as_str()).collect();
        return Err((
            DenyReason::RoleNotAllowed,
            format!(
                "role {} ({identity}) may not call {path} (allowed: {})",
                identity.role,
                allowed.join(", ")
            ),
        ));
    }
    Ok(identity)
}

/// Called once per denial (for a counter by reason and a log line).
pub type DenyHook = Arc<dyn Fn(DenyReason, &str) + Send + Sync>;

/// The tower layer: `Server::builder().layer(AuthzLayer::new(reader, hook))`.
#[derive(Clone)]
pub struct AuthzLayer {
    reader: Arc<IdentityReader>,
    on_deny: Option<DenyHook>,
}

impl std::fmt::Debug for AuthzLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthzLayer")
            .field("trust_domain", &self.reader.trust_domain())
            .finish_non_exhaustive()
    }
}

impl AuthzLayer {
    /// `reader`: a trust domain (`br/...` ids only) or an [`IdentityReader`] with the
    /// process's role map.
    pub fn new(reader: impl Into<IdentityReader>, on_deny: Option<DenyHook>) -> AuthzLayer {
        AuthzLayer {
            reader: Arc::new(reader.into()),
            on_deny,
        }
    }
}

impl<S> tower::Layer<S> for AuthzLayer {
    type Service = Authz<S>;

    fn layer(&self, inner: S) -> Authz<S> {
        Authz {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`AuthzLayer`] wraps around a server's routes.
#[derive(Clone, Debug)]
pub struct Authz<S> {
    inner: S,
    layer: AuthzLayer,
}

impl<S, B, R> tower::Service<http::Request<B>> for Authz<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = futures::future::Either<
        S::Future,
        futures::future::Ready<Result<http::Response<R>, S::Error>>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let certs = req
            .extensions()
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(|info| info.peer_certs());
        let leaf = certs.as_ref().and_then(|c| c.first()).map(|c| c.as_ref());
        let path = req.uri().path().to_owned();
        match authorize(&path, leaf, &self.layer.reader) {
            Ok(identity) => {
                req.extensions_mut().insert(identity);
                futures::future::Either::Left(self.inner.call(req))
            }
            Err((reason, message)) => {
                if let Some(hook) = &self.layer.on_deny {
                    hook(reason, &message);
                }
                tracing::warn!(reason = reason.label(), %message, "call denied");
                let status = tonic::Status::permission_denied(message);
                futures::future::Either::Right(futures::future::ready(Ok(status.into_http())))
            }
        }
    }
}

/// The caller's identity, from a tonic request that passed the layer. `None` on a plaintext
/// (loopback) server.
pub fn caller<T>(req: &tonic::Request<T>) -> Option<&Identity> {
    req.extensions().get::<Identity>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_admits_each_role_only_where_it_needs_to() {
        let m = |s: &str, m: &str| format!("/{s}/{m}");
        let cases: Vec<(String, Vec<Role>)> = vec![
            (m(TELEMETRY, "Report"), vec![Role::Worker]),
            (m(SNAPSHOT, "Apply"), vec![Role::Ingest]),
            (m(SNAPSHOT, "Reserve"), vec![Role::Decision]),
            (m(SNAPSHOT, "ReserveStream"), vec![Role::Decision]),
            (m(SNAPSHOT, "Release"), vec![Role::Decision]),
            (m(SNAPSHOT, "Watch"), vec![Role::Decision, Role::Admin]),
            (m(SNAPSHOT, "Get"), vec![Role::Decision, Role::Admin]),
            (m(SNAPSHOT, "ListGroups"), vec![Role::Admin]),
            (m(SNAPSHOT, "SetCordon"), vec![Role::Admin]),
            (m(DECISION, "Assign"), vec![Role::Gateway, Role::Admin]),
            (m(DECISION, "Cancel"), vec![Role::Gateway, Role::Admin]),
            (m(EXT_PROC, "Process"), vec![Role::Gateway, Role::Admin]),
            (m("grpc.health.v1.Health", "Check"), Role::ALL.to_vec()),
            (
                m(
                    "grpc.reflection.v1alpha.ServerReflection",
                    "ServerReflectionInfo",
                ),
                Role::ALL.to_vec(),
            ),
        ];
        for (path, want) in cases {
            assert_eq!(allowed_roles(&path), Some(want.as_slice()), "{path}");
        }
        for unknown in [
            "/balanceroute.v1.Snapshot/Drop",
            "/balanceroute.v1.Other/Get",
            "Assign",
            "/",
            "",
        ] {
            assert_eq!(allowed_roles(unknown), None, "{unknown}");
        }
    }

    #[test]
    fn no_certificate_is_denied() {
        let path = format!("/{DECISION}/Assign");
        let (reason, _) = authorize(&path, None, &IdentityReader::new("td")).unwrap_err();
        assert_eq!(reason, DenyReason::NoCertificate);
    }
}
