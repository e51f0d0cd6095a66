//! The binding functions: `--listen` for a gRPC server or a plain listener, and the admin port,
//! each naming the flag in its error.
//!
//! Separate from [`super::main`] and [`Running`]: what a service's `start` calls first.

use super::*;

/// Binds `--listen` for a gRPC server with the `--shutdown-grace` drain, HTTP/2 keepalive
/// and, when `edge` has TLS, mutual TLS with per-method authorisation; returns it with the
/// bound address.
pub async fn bind_grpc(
    common: &CommonArgs,
    edge: &Edge,
) -> Result<(GrpcServer, SocketAddr), StartError> {
    bind_grpc_on(common, edge, "--listen", common.listen).await
}

/// [`bind_grpc`] for another gRPC port of the service (`flag` names it in errors, e.g.
/// br-decision's `--ext-proc-listen`): the same TLS, authorisation, keepalive, drain and
/// accept limits as `--listen`, and the same loopback-only rule without TLS.
pub async fn bind_grpc_on(
    common: &CommonArgs,
    edge: &Edge,
    flag: &'static str,
    addr: SocketAddr,
) -> Result<(GrpcServer, SocketAddr), StartError> {
    if edge.tls.is_none() {
        common
            .tls
            .check_bind(addr)
            .map_err(|e| StartError::Config(format!("{flag}: {e}")))?;
    }
    let bind_err = |source| StartError::Bind { flag, addr, source };
    let server = GrpcServer::bind(addr)
        .await
        .map_err(bind_err)?
        .with_grace(common.shutdown_grace)
        .with_keepalive(common.keepalive())
        .with_max_connection_age(common.max_connection_age())
        .with_max_streams_per_connection(common.max_streams_per_connection)
        .with_tls(edge.serving())
        .with_accept_limits(common.accept_limits(descriptor_limit()), edge.accept_hook())
        .with_oversize_hook(edge.oversize_hook())
        .with_in_flight_budget(edge.in_flight_budget());
    let addr = server.local_addr().map_err(bind_err)?;
    Ok((server, addr))
}

/// The process's soft descriptor limit (`ulimit -n`), when it has one.
pub fn descriptor_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

/// Binds `--listen` as a plain TCP listener (the shim's HTTP proxy); returns it with the bound
/// address.
pub async fn bind_listen(
    common: &CommonArgs,
    edge: &Edge,
) -> Result<(br_trust::accept::AcceptListener, SocketAddr), StartError> {
    let bind_err = |source| StartError::Bind {
        flag: "--listen",
        addr: common.listen,
        source,
    };
    let listener = TcpListener::bind(common.listen).await.map_err(bind_err)?;
    let addr = listener.local_addr().map_err(bind_err)?;
    let listener = br_trust::accept::AcceptListener::new(
        listener,
        common.accept_limits(descriptor_limit()),
        edge.accept_hook(),
    )
    .map_err(bind_err)?;
    Ok((listener, addr))
}

/// Starts the admin server on `--admin-listen`; it stops when `stop` is cancelled.
pub async fn start_admin(
    common: &CommonArgs,
    edge: &Edge,
    registry: &prometheus::Registry,
    readiness: &Readiness,
    stop: &CancellationToken,
) -> Result<AdminServer, StartError> {
    start_admin_of(
        common,
        edge,
        std::slice::from_ref(registry),
        readiness,
        axum::Router::new(),
        stop,
    )
    .await
}

/// [`start_admin`] whose `/metrics` gathers several registries (the all-in-one's
/// components), with the service's own `extra` routes beside `/metrics`, `/livez` and
/// `/readyz` (br-decision's live page); under TLS they need the admin role, as `/metrics` does.
pub async fn start_admin_of(
    common: &CommonArgs,
    edge: &Edge,
    registries: &[prometheus::Registry],
    readiness: &Readiness,
    extra: axum::Router,
    stop: &CancellationToken,
) -> Result<AdminServer, StartError> {
    AdminServer::start_gathering(
        common.admin_listen,
        edge.tls.clone(),
        registries.to_vec(),
        readiness.clone(),
        extra,
        stop.clone(),
    )
    .await
    .map_err(|source| StartError::Bind {
        flag: "--admin-listen",
        addr: common.admin_listen,
        source,
    })
}

/// Waits for the admin server started by [`start_admin`].
pub async fn wait_admin(admin: AdminServer) -> Result<(), ServeError> {
    admin.wait().await.map_err(|source| ServeError::Io {
        server: "admin",
        source,
    })
}
