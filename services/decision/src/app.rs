//! Wiring: one group task and one Watch follower per served group, the gRPC server (Decision,
//! health, reflection) and the admin server. Used by `main` and by the integration tests.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Context as _;
use br_client::watch::{WatchConfig, Watcher};
use br_core::build_policy;
use br_proto::service_names;
use br_proto::v1::decision_server::DecisionServer;
use br_runtime::admin::{AdminServer, Readiness};
use br_runtime::serve::{GrpcServer, HealthStatus, ServeOutcome};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::DecisionConfig;
use crate::group::{GroupCore, GroupStats};
use crate::metrics::Metrics;
use crate::service::DecisionService;
use crate::task::{Feed, GroupHandle, OnReady, spawn_group};
use crate::upstream::{GrpcSnapshot, SnapshotOps, snapshot_channel};

/// A running decision service.
#[derive(Debug)]
pub struct Running {
    grpc_addr: SocketAddr,
    admin_addr: SocketAddr,
    metrics: Metrics,
    readiness: Readiness,
    groups: Vec<GroupHandle>,
    shutdown: CancellationToken,
    server: JoinHandle<Result<ServeOutcome, tonic::transport::Error>>,
    admin: AdminServer,
    after: CancellationToken,
}

impl Running {
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    /// The numbers of one group's task (pool size, reservations, ...).
    pub async fn stats(&self, group: &str) -> Option<GroupStats> {
        let h = self.groups.iter().find(|h| h.group().as_str() == group)?;
        h.stats().await
    }

    /// Starts the shutdown (same as SIGTERM) and waits for the drain.
    pub async fn stop(self) -> anyhow::Result<ServeOutcome> {
        self.shutdown.cancel();
        self.wait().await
    }

    /// Waits until the gRPC server has drained after the shutdown token was cancelled, then
    /// stops the followers, the group tasks and the admin server.
    pub async fn wait(self) -> anyhow::Result<ServeOutcome> {
        let outcome = self.server.await.context("gRPC server task")?;
        self.after.cancel();
        drop(self.groups);
        self.admin.wait().await.context("admin server")?;
        Ok(outcome?)
    }
}

/// Starts everything; returns once the ports are bound. The service becomes ready (and its
/// Decision health SERVING) when every group has a complete σ.
pub async fn start(cfg: DecisionConfig, shutdown: CancellationToken) -> anyhow::Result<Running> {
    let metrics = Metrics::new().context("metrics")?;
    let readiness = Readiness::default();
    metrics.ready.set(0);
    // Followers, group tasks and the admin port outlive the gRPC drain (waiting calls still
    // need ticks and σ); they stop after it.
    let after = CancellationToken::new();

    let channel = snapshot_channel(&cfg.snapshot_addr)
        .with_context(|| format!("--snapshot-addr {:?}", cfg.snapshot_addr))?;
    let ops: Arc<dyn SnapshotOps> =
        Arc::new(GrpcSnapshot::new(channel.clone(), cfg.reserve_timeout));

    let n_groups = cfg.groups.len();
    let synced = Arc::new(AtomicUsize::new(0));
    let mut groups = Vec::with_capacity(n_groups);
    for group in &cfg.groups {
        metrics.init_group(group.as_str());
        let policy = build_policy(&cfg.policy).context("--policy")?;
        let gm = metrics.group(group.as_str());
        let core = GroupCore::new(group.clone(), policy, cfg.group.clone(), gm.clone());
        let (watch, updates) = Watcher::spawn(channel.clone(), WatchConfig::new(group.as_str()));
        let on_ready: OnReady = {
            let synced = Arc::clone(&synced);
            let readiness = readiness.clone();
            let ready = metrics.ready.clone();
            let group = group.clone();
            Box::new(move || {
                tracing::info!(group = %group, "group has a complete σ");
                if synced.fetch_add(1, Ordering::SeqCst) + 1 == n_groups {
                    ready.set(1);
                    readiness.set(true);
                    tracing::info!("ready: every group has a complete σ");
                }
            })
        };
        let (handle, _task) = spawn_group(
            core,
            Arc::clone(&ops),
            Some(Feed::new(watch, updates)),
            cfg.ticks,
            gm,
            Some(on_ready),
            shutdown.clone(),
        );
        groups.push(handle);
    }

    let admin = AdminServer::start(
        cfg.admin_listen,
        metrics.registry.clone(),
        readiness.clone(),
        after.clone(),
    )
    .await
    .with_context(|| format!("binding --admin-listen {}", cfg.admin_listen))?;
    let admin_addr = admin.local_addr();

    // br-runtime sets TCP_NODELAY on accepted connections (Nagle + delayed ACK cost up to
    // 40 ms per unary call at low rates).
    let server = GrpcServer::bind(cfg.listen)
        .await
        .with_context(|| format!("binding --listen {}", cfg.listen))?
        .with_grace(cfg.shutdown_grace);
    let grpc_addr = server.local_addr()?;
    let health = server.health_reporter();
    health
        .set_service_status(service_names::DECISION, HealthStatus::NotServing)
        .await;
    // Decision's health follows readiness (NOT_SERVING until σ is complete, and from shutdown).
    tokio::spawn(br_runtime::serve::follow_readiness(
        health,
        readiness.clone(),
        vec![service_names::DECISION.to_owned()],
        shutdown.clone(),
    ));

    let svc = DecisionService::new(
        groups.clone(),
        metrics.clone(),
        cfg.max_wait,
        shutdown.clone(),
    );
    let routes = tonic::service::Routes::new(DecisionServer::new(svc));
    let server = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { server.serve(routes, &[], shutdown).await })
    };
    tracing::info!(grpc = %grpc_addr, admin = %admin_addr, policy = %cfg.policy.kind,
        groups = ?cfg.groups, snapshot = %cfg.snapshot_addr, "br-decision started");
    Ok(Running {
        grpc_addr,
        admin_addr,
        metrics,
        readiness,
        groups,
        shutdown,
        server,
        admin,
        after,
    })
}
