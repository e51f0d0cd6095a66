//! Wiring: one group task and one Watch follower per served group, the gRPC server (Decision,
//! health, reflection), the Envoy ext_proc endpoint picker when `--ext-proc-listen` is given,
//! and the admin server with the live page's sampler and routes. Used by `main` and by the
//! integration tests, and (through [`start_embedded`]) by the all-in-one `br-all`, which mounts
//! the snapshot and ingest handlers on the same gRPC port and hands in the snapshot service
//! in-process.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use br_client::watch::{GrpcWatch, WatchConfig, WatchSource, Watcher};
use br_core::build_policy;
use br_proto::service_names;
use br_proto::v1::decision_server::DecisionServer;
use br_runtime::admin::Readiness;
use br_runtime::serve::ServeOutcome;
use br_runtime::skeleton::{self, Grpc, ServeError, StartError};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tokio_util::sync::CancellationToken;

use crate::config::Args;
use crate::edge::ext_proc::{self, ExtProcService, ExtProcSettings};
use crate::edge::grpc::DecisionService;
use crate::group::Placing;
use crate::group::{GroupCore, GroupStats};
use crate::live::Live;
use crate::metrics::Metrics;
use crate::task::{Feed, GroupHandle, OnPlacing, spawn_group};
use crate::upstream::{GrpcSnapshot, SnapshotOps, snapshot_channel};

/// A running decision service (see [`br_runtime::skeleton::Running`]); its extra is
/// [`Groups`]. Ready (and its Decision health SERVING) while it can place a request: every
/// group has a complete σ and at least one has a live worker (see [`GroupsReadiness`]).
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

    /// One group's σ replica as a snapshot (see [`GroupHandle::sigma`]).
    pub async fn sigma(&self, group: &str) -> Option<br_proto::v1::ClusterSnapshot> {
        let h = self.groups.iter().find(|h| h.group().as_str() == group)?;
        h.sigma().await
    }
}

/// The snapshot service as the group tasks reach it: `Reserve`/`Release` and `Watch`. Over
/// gRPC to `--snapshot-addr` in br-decision; in-process in br-all.
#[derive(Clone)]
pub struct Upstream {
    pub ops: Arc<dyn SnapshotOps>,
    pub watch: Arc<dyn WatchSource>,
}

/// What the all-in-one adds to a decision service ([`start_embedded`]).
pub struct Embedding {
    /// The snapshot service, in-process (instead of `--snapshot-addr`).
    pub upstream: Upstream,
    /// Mounts the other services on the decision's gRPC port (`--listen`).
    pub mount: Box<dyn FnOnce(tonic::service::Routes) -> tonic::service::Routes + Send>,
    /// Their proto names (health SERVING from the start, reflection lists them).
    pub names: Vec<&'static str>,
    /// Their metrics, gathered by the same `/metrics`.
    pub registries: Vec<prometheus::Registry>,
    /// Their readiness: `/readyz` (and [`skeleton::Running::readiness`]) holds while every
    /// one of them and the decision's own does.
    pub readiness: Vec<(&'static str, Readiness)>,
    /// The service name of the port's edge counters
    /// (`balanceroute_<edge_name>_accept_failures_total`, ...).
    pub edge_name: &'static str,
    /// Cancelled once the gRPC drain is over (with the decision's own group tasks): what the
    /// draining calls still need (the snapshot writer for Reserve) stops then, not before.
    pub after: CancellationToken,
    /// Their tasks, awaited once `after` is cancelled.
    pub tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for Embedding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedding")
            .field("names", &self.names)
            .field("edge_name", &self.edge_name)
            .finish_non_exhaustive()
    }
}

/// Starts everything; returns once the ports are bound. The service is ready (and its
/// Decision health SERVING) while it can place a request (see [`GroupsReadiness`]).
pub async fn start(args: &Args, shutdown: CancellationToken) -> Result<Running, StartError> {
    start_with(args, shutdown, None).await
}

/// [`start`] with other services embedded (the all-in-one `br-all`): the snapshot service is
/// called in-process and the embedded services share `--listen` and `--admin-listen`.
pub async fn start_embedded(
    args: &Args,
    shutdown: CancellationToken,
    embedding: Embedding,
) -> Result<Running, StartError> {
    start_with(args, shutdown, Some(embedding)).await
}

async fn start_with(
    args: &Args,
    shutdown: CancellationToken,
    embedding: Option<Embedding>,
) -> Result<Running, StartError> {
    let cfg = args.to_config().map_err(StartError::Config)?;
    let metrics = Metrics::new()?;
    let readiness = Readiness::default();
    metrics.ready.set(0);
    let edge_name = embedding.as_ref().map_or("decision", |e| e.edge_name);
    let edge = skeleton::Edge::load(&args.common, edge_name, &metrics.registry, &shutdown)?;
    // Followers, group tasks and the admin port outlive the gRPC drain (waiting calls still
    // need ticks and σ); they stop after it.
    let after = embedding
        .as_ref()
        .map_or_else(CancellationToken::new, |e| e.after.clone());

    let upstream = match &embedding {
        Some(e) => e.upstream.clone(),
        None => {
            let channel = snapshot_channel(&cfg.snapshot_addr, edge.tls()).map_err(|e| {
                StartError::Upstream {
                    flag: "--snapshot-addr",
                    value: cfg.snapshot_addr.clone(),
                    reason: e.to_string(),
                }
            })?;
            Upstream {
                ops: Arc::new(GrpcSnapshot::new(channel.clone(), cfg.reserve_timeout)),
                watch: Arc::new(GrpcWatch::new(
                    channel,
                    br_client::watch::DEFAULT_MAX_MESSAGE_BYTES,
                )),
            }
        }
    };
    let ops: Arc<dyn SnapshotOps> = Arc::clone(&upstream.ops);

    let n_groups = cfg.groups.len();
    let placing = Arc::new(GroupsReadiness::new(
        cfg.groups.iter().map(|g| g.to_string()),
        readiness.clone(),
        metrics.ready.clone(),
    ));
    let mut groups = Vec::with_capacity(n_groups);
    for group in &cfg.groups {
        metrics.init_group(group.as_str());
        metrics
            .policy_info
            .with_label_values(&[group.as_str(), cfg.policy.kind.name()])
            .set(1);
        let policy =
            build_policy(&cfg.policy).map_err(|e| StartError::Config(format!("--policy: {e}")))?;
        let gm = metrics.group(group.as_str());
        let core = GroupCore::new(group.clone(), policy, cfg.group.clone(), gm.clone());
        // Resubscribe within a few hundred ms of the snapshot service's return (the watcher's
        // own default backs off to 5 s): decisions are stale until then.
        let mut watch_cfg = WatchConfig::new(group.as_str());
        watch_cfg.backoff_max = cfg.watch_backoff_max;
        watch_cfg.backoff_initial = watch_cfg.backoff_initial.min(cfg.watch_backoff_max);
        let (watch, updates) = Watcher::spawn_from(Arc::clone(&upstream.watch), watch_cfg);
        let on_placing: OnPlacing = {
            let placing = Arc::clone(&placing);
            let group = group.to_string();
            Box::new(move |p| placing.update(&group, p))
        };
        let (handle, _task) = spawn_group(
            core,
            Arc::clone(&ops),
            Some(Feed::new(watch, updates)),
            cfg.ticks,
            gm,
            Some(on_placing),
            shutdown.clone(),
        );
        groups.push(handle);
    }

    let (mount, names, registries, parts, tasks) = match embedding {
        None => (None, Vec::new(), Vec::new(), Vec::new(), Vec::new()),
        Some(e) => (Some(e.mount), e.names, e.registries, e.readiness, e.tasks),
    };
    // The admin port's readiness: the decision's own, or with embedded services, all of them.
    let shown = if parts.is_empty() {
        readiness.clone()
    } else {
        let mut all = parts;
        all.push(("decision", readiness.clone()));
        br_runtime::admin::all_of(all, after.clone())
    };
    let mut gathered = vec![metrics.registry.clone()];
    gathered.extend(registries);
    // The live page: one history ring per group, sampled until the admin port stops.
    let live = Live::new(
        cfg.live,
        cfg.policy.kind.name(),
        cfg.groups.iter().map(|g| g.as_str()),
    );
    let sampler = live.spawn_sampler(groups.clone(), metrics.clone(), after.clone());
    let admin = skeleton::start_admin_of(
        &args.common,
        &edge,
        &gathered,
        &shown,
        crate::live::api::router(live),
        &after,
    )
    .await?;
    let admin_addr = admin.local_addr();

    // br-runtime sets TCP_NODELAY on accepted connections (Nagle + delayed ACK cost up to
    // 40 ms per unary call at low rates).
    let (server, grpc_addr) = skeleton::bind_grpc(&args.common, &edge).await?;
    // Decision's health follows readiness (NOT_SERVING until it can place, and from shutdown);
    // embedded services are SERVING from the start.
    let server = server.with_health_following_only(readiness.clone(), &[service_names::DECISION]);
    let mut served: Vec<&'static str> = vec![service_names::DECISION];
    served.extend(names);

    let svc = DecisionService::new(
        groups.clone(),
        metrics.clone(),
        cfg.max_wait,
        shutdown.clone(),
    );
    // The Envoy endpoint picker: its own port, the same edge (TLS, authorisation, limits) and
    // the same Assign path as the gRPC method.
    let ext_proc = match &cfg.ext_proc {
        None => None,
        Some(ext) => {
            let (server, addr) =
                skeleton::bind_grpc_on(&args.common, &edge, "--ext-proc-listen", ext.listen)
                    .await?;
            // Health as the endpoint-picker protocol asks: the ExternalProcessor name and
            // `readiness` follow decision's readiness, `liveness` holds while it serves.
            let server = server
                .with_health_following(readiness.clone())
                .with_probe_names();
            let picker = ExtProcService::new(
                svc.clone(),
                ExtProcSettings {
                    default_group: ext.default_group.clone(),
                    timeout: ext.timeout,
                    max_buffered_bytes: ext.max_buffered_bytes,
                    body_timeout: ext.body_timeout,
                },
                metrics.clone(),
            );
            // A buffered body arrives as one message: allow the picker's body bound, not
            // tonic's 4 MiB default.
            let routes = tonic::service::Routes::new(
                ExternalProcessorServer::new(picker)
                    .max_decoding_message_size(ext_proc::MAX_BODY_BYTES + (64 << 10)),
            );
            // DEBUG: the process's one start-up line (INFO) names this address.
            tracing::debug!(ext_proc = %addr, default_group = ?ext.default_group,
                "Envoy ext_proc endpoint picker listening");
            Some((server, routes, addr))
        }
    };
    let ext_proc_addr = ext_proc.as_ref().map(|(_, _, a)| *a);
    // HTTP/JSON (--http-listen): the same service behind another edge.
    let http = match cfg.http_listen {
        None => None,
        Some(addr) => {
            let listener = crate::edge::http::bind(&args.common, &edge, addr).await?;
            // The gRPC ports' budget: one bound on the bytes still arriving, whichever port
            // they come through (br-all's too: it starts here). `Edge::load` always makes one;
            // without it the flags would still bound this port, as `GrpcServer` does its own.
            let in_flight = edge.in_flight_budget().unwrap_or_else(|| {
                Arc::new(br_runtime::InFlightBudget::new(
                    args.common.max_in_flight_message_bytes,
                    args.common.max_in_flight_message_bytes_per_connection,
                ))
            });
            let router = crate::edge::http::router(
                svc.clone(),
                metrics.clone(),
                crate::edge::http::Authz::of(&edge),
                cfg.max_wait,
                in_flight,
            );
            Some((listener, router))
        }
    };
    let http_addr = http.as_ref().map(|(l, _)| l.local_addr());
    let mut routes = tonic::service::Routes::new(DecisionServer::new(svc));
    // Embedded (br-all), the embedding logs the one start-up line: `--snapshot-addr` is not
    // used there, and one process should not announce itself twice.
    let embedded = mount.is_some();
    if let Some(mount) = mount {
        routes = mount(routes);
    }
    if !embedded {
        tracing::info!(version = env!("CARGO_PKG_VERSION"), grpc = %grpc_addr, http = ?http_addr,
            ext_proc = ?ext_proc_addr, admin = %admin_addr, tls = edge.tls().is_some(),
            policy = %cfg.policy.kind, groups = ?cfg.groups, snapshot = %cfg.snapshot_addr,
            services = ?served, "br-decision started");
    }
    let grace = args.common.shutdown_grace;
    // A request's head has as long as a new connection's first byte (--first-byte-timeout).
    let header_timeout = args.common.first_byte_timeout;
    let http_task = http.map(|(listener, router)| {
        tokio::spawn(crate::edge::http::serve(
            listener,
            router,
            shutdown.clone(),
            grace,
            header_timeout,
        ))
    });
    let serve_shutdown = shutdown.clone();
    let extra = Groups {
        metrics,
        groups: groups.clone(),
    };
    let running = Running::spawn(grpc_addr, admin_addr, shown, shutdown, extra, async move {
        let main = server.serve(routes, &served, serve_shutdown.clone());
        let outcome = match ext_proc {
            None => main.await,
            Some((ext_server, ext_routes, _)) => {
                let ext = ext_server.serve(ext_routes, &[ext_proc::SERVICE_NAME], serve_shutdown);
                match tokio::join!(main, ext) {
                    (Ok(a), Ok(b)) => Ok(if a == ServeOutcome::Drained { b } else { a }),
                    (Err(e), _) | (_, Err(e)) => Err(e),
                }
            }
        };
        // The HTTP/JSON calls drain too (they need the group tasks as much).
        let http_outcome = match http_task {
            None => Ok(()),
            Some(task) => match task.await {
                Ok(r) => r.map(|_| ()).map_err(|source| ServeError::Io {
                    server: "HTTP/JSON",
                    source,
                }),
                Err(e) => Err(ServeError::Task(e)),
            },
        };
        // Only now (the drain is over) the followers, group tasks and admin port stop.
        after.cancel();
        drop(groups);
        for task in tasks {
            task.await?;
        }
        // It holds handles of the group tasks: it must end for them to end.
        sampler.await?;
        skeleton::wait_admin(admin).await?;
        http_outcome?;
        Ok(outcome?)
    })
    .with_http_json(http_addr)
    // The one start-up line is logged above (or by the embedding), not the skeleton's.
    .announced();
    Ok(match ext_proc_addr {
        Some(addr) => running.with_listener(EXT_PROC_KEY, addr),
        None => running,
    })
}

/// The ready-file key (and [`skeleton::Running::listener`] key) of `--ext-proc-listen`.
pub const EXT_PROC_KEY: &str = "ext_proc";

/// Readiness from every group's [`Placing`]. Ready while every group has a complete σ and at
/// least one can place: a group whose workers are all gone answers UNAVAILABLE, but the
/// replica still places the others'. Not ready with zero live workers anywhere (every Assign
/// would be UNAVAILABLE), saying so in `/readyz`'s body and in a WARN log when it was ready.
struct GroupsReadiness {
    placing: Mutex<BTreeMap<String, Placing>>,
    readiness: Readiness,
    gauge: prometheus::IntGauge,
}

impl GroupsReadiness {
    fn new(
        groups: impl Iterator<Item = String>,
        readiness: Readiness,
        gauge: prometheus::IntGauge,
    ) -> Self {
        let g = GroupsReadiness {
            placing: Mutex::new(groups.map(|g| (g, Placing::NoSigma)).collect()),
            readiness,
            gauge,
        };
        g.judge(
            &g.placing
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        g
    }

    fn update(&self, group: &str, p: Placing) {
        let mut all = self
            .placing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        all.insert(group.to_owned(), p);
        tracing::info!(group, placing = ?p, "group readiness");
        self.judge(&all);
    }

    fn judge(&self, all: &BTreeMap<String, Placing>) {
        let named = |want: Placing| {
            all.iter()
                .filter(|(_, p)| **p == want)
                .map(|(g, _)| g.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let why_not = if all.values().any(|p| *p == Placing::NoSigma) {
            Some(format!(
                "no complete σ yet for group(s) {} (waiting for the snapshot service)",
                named(Placing::NoSigma)
            ))
        } else if !all.values().any(|p| *p == Placing::Ready) {
            Some(format!(
                "no live worker in group(s) {}: every Assign would be UNAVAILABLE",
                named(Placing::NoLiveWorker)
            ))
        } else {
            None
        };
        let was = self.readiness.is_ready();
        match why_not {
            None => {
                self.gauge.set(1);
                self.readiness.set(true);
                if !was {
                    tracing::info!("ready: every group has a complete σ and one can place");
                }
            }
            Some(why) => {
                if was {
                    tracing::warn!(reason = %why, "not ready: no Assign can be placed");
                }
                self.gauge.set(0);
                self.readiness.set_not_ready(why);
            }
        }
    }
}
