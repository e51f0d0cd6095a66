//! Wiring: the proxy on `--listen`, the telemetry reporter towards `--ingest-addr` and the
//! admin server, started and stopped as one service. Used by `main` and by the tests.

use std::sync::Arc;
use std::time::Duration;

use br_runtime::admin::Readiness;
use br_runtime::config::Validate as _;
use br_runtime::http_serve::{HttpServing, serve_http};
use br_runtime::serve::ServeOutcome;
use br_runtime::skeleton::ServeError;
use br_runtime::skeleton::{self, Http, StartError};
use tokio_util::sync::CancellationToken;

use crate::config::Args;
use crate::health::{self, Health, HealthMetrics, ProbeConfig};
use crate::metrics::Labelled;
use crate::ranks::RankCheck;
use crate::report::{NullSink, ProgressSink, ReporterSink};
use crate::{Shim, ShimMetrics, topology};

/// A started shim (see [`br_runtime::skeleton::Running`]): `http_addr()` is the proxy.
pub type Running = skeleton::Running<Http>;

/// How often the `ingest_connected` gauge is refreshed from the reporter.
const CONNECTED_REFRESH: Duration = Duration::from_millis(500);

/// Validates `args`, binds the proxy and admin ports (port 0 picks a free one), starts the
/// reporter and serves; everything stops when `shutdown` is cancelled. Open streams get
/// `--shutdown-grace` to finish, then they are cut.
pub async fn start(args: &Args, shutdown: CancellationToken) -> Result<Running, StartError> {
    args.validate().map_err(StartError::Config)?;
    let ids = args.ranks().map_err(StartError::Config)?;
    let several = args.topology.worker_ids.is_some();
    // Every series says whose it is: each rank's own metrics, and the process's (the accept
    // loop, TLS, the engine's health), each with the group and the worker.
    let process_registry = prometheus::Registry::new();
    let mut labelled = Labelled::default().with(
        process_registry.clone(),
        &[("group", &args.group), ("worker", &args.worker_label())],
    );
    let mut rank_metrics = Vec::with_capacity(ids.len());
    for id in &ids {
        let r = prometheus::Registry::new();
        rank_metrics.push(ShimMetrics::new(&r)?);
        labelled = labelled.with(r, &[("group", &args.group), ("worker", &id.to_string())]);
    }
    let registry = prometheus::Registry::new();
    registry.register(Box::new(labelled))?;
    let health_metrics = HealthMetrics::new(&process_registry)?;
    // The proxy port carries the engine's own (plaintext HTTP) traffic, as the engine's port
    // does; TLS and the loopback default apply to the admin port and to the ingest stream.
    let edge = skeleton::Edge::load(&args.common, "shim", &process_registry, &shutdown)?;
    if let Some(tls) = edge.tls()
        && !args.ingest_addr.is_empty()
    {
        certificate_covers(tls, &args.group, &ids).map_err(StartError::Config)?;
    }
    let probing = !args.health.engine_probe_interval.is_zero();
    let (listener, http_addr) = skeleton::bind_listen(&args.common, &edge).await?;
    let endpoint = args
        .endpoint
        .clone()
        .unwrap_or_else(|| format!("http://{http_addr}"));

    // One reporter (one telemetry stream) per rank.
    let mut reporters = Vec::new();
    let mut sinks: Vec<Arc<dyn ProgressSink>> = Vec::with_capacity(ids.len());
    for &id in &ids {
        if args.ingest_addr.is_empty() {
            sinks.push(Arc::new(NullSink));
            continue;
        }
        let mut cfg = br_client::reporter::ReporterConfig::new(
            args.ingest_addr.clone(),
            args.group.clone(),
            id,
            args.capacity,
        );
        cfg.endpoint = if several {
            topology::rank_endpoint(&endpoint, id)
        } else {
            endpoint.clone()
        };
        cfg.tls = edge.tls().cloned();
        // No Hello before the engine has answered a probe.
        cfg.serving = !probing;
        let tuning = br_client::reporter::ReporterTuning {
            flush_interval: args.report_flush_interval,
            ..Default::default()
        };
        let handle = br_client::reporter::Reporter::spawn_tuned(cfg, tuning).map_err(|e| {
            StartError::Upstream {
                flag: "--ingest-addr",
                value: args.ingest_addr.clone(),
                reason: e.to_string(),
            }
        })?;
        reporters.push(handle.clone());
        sinks.push(Arc::new(ReporterSink(handle)));
    }
    if args.ingest_addr.is_empty() {
        tracing::warn!("no --ingest-addr: forwarding without reporting progress");
    }

    let readiness = Readiness::default();
    let health = Arc::new(Health::new(
        args.health.engine_failure_threshold,
        sinks.clone(),
        Some(readiness.clone()),
        Some(health_metrics),
        probing,
    ));
    let header = match &args.topology.dp_rank_header {
        Some(h) => Some(
            axum::http::HeaderName::from_bytes(h.as_bytes())
                .map_err(|e| StartError::Config(format!("--dp-rank-header {h:?}: {e}")))?,
        ),
        None => None,
    };
    let pin = |rank| topology::Pin {
        rank,
        header: header.clone(),
        field: args.topology.dp_rank_field.clone(),
    };
    let rank_check = if probing && args.topology.verify_ranks {
        RankCheck::new(&args.upstream, ids.iter().map(|&id| pin(id)).collect()).map_err(|e| {
            StartError::Upstream {
                flag: "--upstream",
                value: args.upstream.clone(),
                reason: e.to_string(),
            }
        })?
    } else {
        None
    };
    let (refused_tx, refused_rx) = tokio::sync::oneshot::channel::<String>();
    let probe_url = format!(
        "{}{}",
        args.upstream.trim_end_matches('/'),
        args.health.engine_probe_path
    );
    health::spawn_prober(
        health.clone(),
        ProbeConfig {
            url: probing.then(|| probe_url.clone()),
            interval: if probing {
                args.health.engine_probe_interval
            } else {
                health::DEFAULT_PROBE_INTERVAL
            },
            timeout: args.health.engine_probe_timeout,
            rank_check,
        },
        refused_tx,
        shutdown.clone(),
    )
    .map_err(|e| StartError::Upstream {
        flag: "--upstream",
        value: args.upstream.clone(),
        reason: e.to_string(),
    })?;

    let mut shims: std::collections::BTreeMap<u32, Arc<Shim>> = std::collections::BTreeMap::new();
    let mut first: Option<Arc<Shim>> = None;
    for ((&id, sink), metrics) in ids.iter().zip(&sinks).zip(&rank_metrics) {
        let shim = Shim::new(
            &args.upstream,
            args.inject_usage,
            sink.clone(),
            metrics.clone(),
        )
        .map_err(|e| StartError::Upstream {
            flag: "--upstream",
            value: args.upstream.clone(),
            reason: e.to_string(),
        })?;
        let shim = match &first {
            // the ranks of one process share its limits and its connections to the engine
            Some(f) => shim.sharing_limits_of(f),
            None => shim
                .with_limits(args.max_body_bytes, args.max_concurrent_requests)
                .with_body_budget(args.max_buffered_body_bytes, args.body_timeout),
        }
        .with_health(health.clone())
        .with_request_id_required(args.require_request_id)
        .with_pin(pin(id));
        let shim = Arc::new(shim);
        first.get_or_insert_with(|| shim.clone());
        shims.insert(id, shim);
    }
    let admin =
        skeleton::start_admin(&args.common, &edge, &registry, &readiness, &shutdown).await?;
    let admin_addr = admin.local_addr();

    // The ingest_connected gauge and the refusals counter follow each rank's reporter.
    for (sink, metrics) in sinks.iter().zip(&rank_metrics) {
        let sink = sink.clone();
        let gauge = metrics.ingest_connected.clone();
        let refusals = metrics.ingest_refusals.clone();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(CONNECTED_REFRESH);
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        gauge.set(i64::from(sink.connected()));
                        // the reporter's count only rises; the counter follows it
                        let seen = sink.refusals();
                        refusals.inc_by(seen.saturating_sub(refusals.get()));
                    }
                    () = stop.cancelled() => break,
                }
            }
        });
    }

    tracing::info!(listen = %http_addr, admin = %admin_addr, upstream = %args.upstream,
        group = %args.group, workers = %args.worker_label(), capacity = args.capacity,
        endpoint = %endpoint, probe = %if probing { probe_url.as_str() } else { "off" },
        dp_rank_header = ?args.topology.dp_rank_header, dp_rank_field = ?args.topology.dp_rank_field,
        "br-shim serving (ready once the engine answers a probe)");
    let app = match first {
        Some(only) if !several => crate::router(only),
        _ => crate::rank_router::rank_router(shims),
    };
    let grace = args.common.shutdown_grace;
    let header_timeout = args.header_read_timeout;
    let serve_shutdown = shutdown.clone();
    Ok(Running::spawn(
        http_addr,
        admin_addr,
        readiness,
        shutdown,
        (),
        async move {
            // the caller bounds the drain (below): streams end with the reporters' shutdown
            let how = HttpServing {
                name: "proxy",
                header_timeout,
                grace: None,
            };
            let server = serve_http(listener, app, how, serve_shutdown.clone());
            // A rank the engine refuses ends the shim (exit 2) once it has drained.
            let refused = async {
                match refused_rx.await {
                    Ok(msg) => {
                        serve_shutdown.cancel();
                        msg
                    }
                    Err(_) => std::future::pending().await,
                }
            };
            let mut refusal = None;
            tokio::pin!(server, refused);
            let outcome = tokio::select! {
                o = &mut server => o,
                msg = &mut refused => {
                    refusal = Some(msg);
                    server.await
                }
                // Streams can be long: after the grace period, stop waiting for them.
                () = async { serve_shutdown.cancelled().await; tokio::time::sleep(grace).await } => {
                    tracing::warn!("grace period over; closing open streams");
                    ServeOutcome::GraceExpired
                }
            };
            // each flushes and ends its stream; together, not one after another
            futures::future::join_all(reporters.iter().map(|r| r.shutdown())).await;
            skeleton::wait_admin(admin).await?;
            match refusal {
                Some(msg) => Err(ServeError::Config(msg)),
                None => Ok(outcome),
            }
        },
    )
    // "br-shim serving" above is the one start-up line, not the skeleton's.
    .announced())
}

/// Under mutual TLS ingest admits a rank's Hello only if the shim's certificate names that
/// rank. A certificate that misses one of the ranks this shim serves would get that rank's
/// stream refused again at every retry while the others report, a half-working shim; it is
/// refused here instead, saying which certificate the ranks need.
fn certificate_covers(tls: &br_trust::TlsMaterial, group: &str, ids: &[u32]) -> Result<(), String> {
    // An identity this process cannot read (a service-account id that its own
    // --spiffe-role-map does not name) is left for ingest, whose map decides.
    let Ok(own) = tls.own_identity() else {
        return Ok(());
    };
    let admits = |id: u32| own.worker.as_ref().is_some_and(|s| s.admits(group, id));
    let missing: Vec<String> = ids
        .iter()
        .filter(|&&id| !admits(id))
        .map(ToString::to_string)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let is_for = own
        .worker
        .as_ref()
        .map_or_else(|| format!("role {}", own.role), ToString::to_string);
    let wanted = match (ids.first(), ids.last()) {
        (Some(first), Some(last)) if first != last => format!(
            "a certificate for all of them, spiffe://{}/br/worker/{group}/{first}-{last} \
             (br-certs --worker-range {first}-{last})",
            tls.trust_domain()
        ),
        _ => format!(
            "a certificate for spiffe://{}/br/worker/{group}/{}",
            tls.trust_domain(),
            ids.first().copied().unwrap_or_default()
        ),
    };
    Err(format!(
        "--tls-cert: the certificate ({own}) is for {is_for}, so ingest would refuse the Hello \
         of group {group:?} worker {}: this shim serves {} and needs {wanted}",
        missing.join(", "),
        if ids.len() == 1 {
            format!("worker {}", ids[0])
        } else {
            format!(
                "workers {}",
                ids.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    ))
}
