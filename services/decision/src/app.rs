//! Wiring: one group task and one Watch follower per served group, the gRPC server (Decision,
//! health, reflection) and the admin server. Used by `main` and by the integration tests.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use br_client::watch::{WatchConfig, Watcher};
use br_core::build_policy;
use br_proto::service_names;
use br_proto::v1::decision_server::DecisionServer;
use br_runtime::admin::Readiness;
use br_runtime::skeleton::{self, Grpc, StartError};
use tokio_util::sync::CancellationToken;

use crate::config::Args;
use crate::group::{GroupCore, GroupStats};
use crate::metrics::Metrics;
use crate::service::DecisionService;
use crate::task::{Feed, GroupHandle, OnReady, spawn_group};
use crate::upstream::{GrpcSnapshot, SnapshotOps, snapshot_channel};

/// A running decision service (see [`br_runtime::skeleton::Running`]); its extra is
/// [`Groups`]. Ready (and its Decision health SERVING) once every group has a complete σ.
pub type Running = skeleton::Running<Grpc, Groups>;

/// What only a running decision service has: its metrics and its group tasks.
#[derive(Debug)]
pub struct Groups {
    metrics: Metrics,
    groups: Vec<GroupHandle>,
}

impl Groups {
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The numbers of one group's task (pool size, reservations, ...).
    pub async fn stats(&self, group: &str) -> Option<GroupStats> {
        let h = self.groups.iter().find(|h| h.group().as_str() == group)?;
        h.stats().await
    }
}

/// Starts everything; returns once the ports are bound. The service becomes ready (and its
/// Decision health SERVING) when every group has a complete σ.
pub async fn start(args: &Args, shutdown: CancellationToken) -> Result<Running, StartError> {
    let cfg = args.to_config().map_err(StartError::Config)?;
    let metrics = Metrics::new()?;
    let readiness = Readiness::default();
    metrics.ready.set(0);
    let edge = skeleton::Edge::load(&args.common, "decision", &metrics.registry, &shutdown)?;
    // Followers, group tasks and the admin port outlive the gRPC drain (waiting calls still
    // need ticks and σ); they stop after it.
    let after = CancellationToken::new();

    let channel =
        snapshot_channel(&cfg.snapshot_addr, edge.tls()).map_err(|e| StartError::Upstream {
            flag: "--snapshot-addr",
            value: cfg.snapshot_addr.clone(),
            reason: e.to_string(),
        })?;
    let ops: Arc<dyn SnapshotOps> =
        Arc::new(GrpcSnapshot::new(channel.clone(), cfg.reserve_timeout));

    let n_groups = cfg.groups.len();
    let synced = Arc::new(AtomicUsize::new(0));
    let mut groups = Vec::with_capacity(n_groups);
    for group in &cfg.groups {
        metrics.init_group(group.as_str());
        let policy =
            build_policy(&cfg.policy).map_err(|e| StartError::Config(format!("--policy: {e}")))?;
        let gm = metrics.group(group.as_str());
        let core = GroupCore::new(group.clone(), policy, cfg.group.clone(), gm.clone());
        // Resubscribe within a few hundred ms of the snapshot service's return (the watcher's
        // own default backs off to 5 s): decisions are stale until then.
        let mut watch_cfg = WatchConfig::new(group.as_str());
        watch_cfg.backoff_max = cfg.watch_backoff_max;
        watch_cfg.backoff_initial = watch_cfg.backoff_initial.min(cfg.watch_backoff_max);
        let (watch, updates) = Watcher::spawn(channel.clone(), watch_cfg);
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

    let admin =
        skeleton::start_admin(&args.common, &edge, &metrics.registry, &readiness, &after).await?;
    let admin_addr = admin.local_addr();

    // br-runtime sets TCP_NODELAY on accepted connections (Nagle + delayed ACK cost up to
    // 40 ms per unary call at low rates).
    let (server, grpc_addr) = skeleton::bind_grpc(&args.common, &edge).await?;
    // Decision's health follows readiness (NOT_SERVING until it can place, and from shutdown).
    let server = server.with_health_following(readiness.clone());

    let svc = DecisionService::new(
        groups.clone(),
        metrics.clone(),
        cfg.max_wait,
        shutdown.clone(),
    );
    let routes = tonic::service::Routes::new(DecisionServer::new(svc));
    tracing::info!(grpc = %grpc_addr, admin = %admin_addr, policy = %cfg.policy.kind,
        groups = ?cfg.groups, snapshot = %cfg.snapshot_addr, "br-decision started");
    let serve_shutdown = shutdown.clone();
    let extra = Groups {
        metrics,
        groups: groups.clone(),
    };
    Ok(Running::spawn(
        grpc_addr,
        admin_addr,
        readiness,
        shutdown,
        extra,
        async move {
            let outcome = server
                .serve(routes, &[service_names::DECISION], serve_shutdown)
                .await;
            // Only now (the drain is over) the followers, group tasks and admin port stop.
            after.cancel();
            drop(groups);
            skeleton::wait_admin(admin).await?;
            Ok(outcome?)
        },
    ))
}
