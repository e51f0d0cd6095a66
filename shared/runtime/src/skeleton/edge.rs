//! [`Edge`]: what a service's listeners enforce and count (mutual TLS, per-method
//! authorisation, the accept bound) with their refusal counters, made once per process.
//!
//! Separate from binding: one edge is shared by every server and client of the process.

use super::*;

/// A service's edge: what its listeners enforce and count. Mutual TLS and per-method
/// authorisation (when `--tls-*` are given) with their refusal counters, and the accept bound
/// (`--max-connections`, `--first-byte-timeout`, on every port, TLS or not) with its failure
/// counter. Made once per process by [`Edge::load`] and shared by its servers and clients.
#[derive(Clone, Default)]
pub struct Edge {
    pub(super) tls: Option<Arc<br_trust::TlsMaterial>>,
    /// `balanceroute_<service>_calls_denied_total{reason}` (TLS only).
    denied: Option<prometheus::IntCounterVec>,
    /// `balanceroute_<service>_tls_handshake_failures_total{reason}` (TLS only).
    handshake_failures: Option<prometheus::IntCounterVec>,
    /// `balanceroute_<service>_accept_failures_total{reason}` (every port).
    accept_failures: Option<prometheus::IntCounterVec>,
    /// `balanceroute_<service>_oversize_calls_total`, shared by every gRPC port; registered
    /// when the first gRPC port is bound, so a service without one (br-shim) does not export a
    /// counter that can never move.
    oversize_calls: Option<Arc<OversizeCounter>>,
    /// The process's budget of unfinished request messages, shared by every gRPC port (and
    /// br-decision's HTTP/JSON bodies), with its counters; made when the first gRPC port is
    /// bound (as the oversize counter).
    in_flight: Option<Arc<InFlightCell>>,
}

/// The in-flight budget's settings and registry, and the budget once a gRPC port asked for it.
struct InFlightCell {
    service: String,
    process_bytes: usize,
    connection_bytes: usize,
    registry: prometheus::Registry,
    budget: std::sync::OnceLock<Arc<crate::in_flight::InFlightBudget>>,
}

impl InFlightCell {
    fn get(&self) -> Arc<crate::in_flight::InFlightBudget> {
        self.budget
            .get_or_init(|| {
                let budget = crate::in_flight::InFlightBudget::new(
                    self.process_bytes,
                    self.connection_bytes,
                );
                let refusals = prometheus::IntCounterVec::new(
                    prometheus::Opts::new(
                        format!("balanceroute_{}_in_flight_refusals_total", self.service),
                        "Calls refused RESOURCE_EXHAUSTED (429 on HTTP/JSON) because the \
                         unfinished request messages held would pass the budget, by scope: \
                         process (--max-in-flight-message-bytes) or connection \
                         (--max-in-flight-message-bytes-per-connection)",
                    ),
                    &["scope"],
                );
                let held = prometheus::IntGauge::new(
                    format!("balanceroute_{}_in_flight_message_bytes", self.service),
                    "Bytes of unfinished request messages the process holds (declared \
                     lengths; what has arrived of an HTTP/JSON body without one), across its \
                     gRPC ports and HTTP/JSON bodies",
                );
                let (Ok(refusals), Ok(held)) = (refusals, held) else {
                    return Arc::new(budget);
                };
                // registered once per process, so a second registration cannot collide
                let _ = self.registry.register(Box::new(refusals.clone()));
                let _ = self.registry.register(Box::new(held.clone()));
                for scope in [
                    crate::in_flight::Scope::Process,
                    crate::in_flight::Scope::Connection,
                ] {
                    refusals.with_label_values(&[scope.as_str()]);
                }
                Arc::new(budget.with_hooks(
                    Some(Arc::new(move |scope: crate::in_flight::Scope| {
                        refusals.with_label_values(&[scope.as_str()]).inc();
                    })),
                    Some(Arc::new(move |bytes: usize| {
                        held.set(i64::try_from(bytes).unwrap_or(i64::MAX));
                    })),
                ))
            })
            .clone()
    }
}

/// The oversize counter's name and registry, and the counter once a gRPC port asked for it.
struct OversizeCounter {
    name: String,
    registry: prometheus::Registry,
    counter: std::sync::OnceLock<Option<prometheus::IntCounter>>,
}

impl OversizeCounter {
    fn get(&self) -> Option<prometheus::IntCounter> {
        self.counter
            .get_or_init(|| {
                let c = prometheus::IntCounter::new(
                    self.name.clone(),
                    "Unary and server-streaming calls refused RESOURCE_EXHAUSTED because the \
                     request message was above the port's message size limit (client-streaming \
                     methods count theirs in their own refusal counter)",
                )
                .ok()?;
                // registered once per process, so a second registration cannot collide
                self.registry.register(Box::new(c.clone())).ok()?;
                Some(c)
            })
            .clone()
    }
}

impl std::fmt::Debug for Edge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Edge")
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl Edge {
    /// Refuses a plaintext admin port beyond loopback (unless `--allow-insecure-remote`; the
    /// gRPC port is checked by [`bind_grpc`]), loads the certificate files and follows their
    /// rotation until `shutdown`, and registers the edge's counters in `registry`.
    pub fn load(
        common: &CommonArgs,
        service: &str,
        registry: &prometheus::Registry,
        shutdown: &CancellationToken,
    ) -> Result<Edge, StartError> {
        common
            .tls
            .check_bind(common.admin_listen)
            .map_err(|e| StartError::Config(format!("--admin-listen: {e}")))?;
        let tls = common.tls.load().map_err(|e| match e {
            br_trust::tls::TlsError::RoleMap(e) => {
                StartError::Config(format!("--spiffe-role-map: {e}"))
            }
            e => StartError::Config(format!("--tls-cert/--tls-key/--tls-ca: {e}")),
        })?;
        let accept_failures = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                format!("balanceroute_{service}_accept_failures_total"),
                "Connections the gRPC port's accept loop failed or closed before any request, by \
                 reason: accept_error (EMFILE ...; backing off), silent (no first byte in time), \
                 peer_limit (closed: its address held --max-connections-per-peer)",
            ),
            &["reason"],
        )?;
        registry.register(Box::new(accept_failures.clone()))?;
        // exported at 0 from the start, so rate() and alerts see the first one
        for reason in ["accept_error", "silent", "peer_limit"] {
            accept_failures.with_label_values(&[reason]);
        }
        let oversize_calls = Arc::new(OversizeCounter {
            name: format!("balanceroute_{service}_oversize_calls_total"),
            registry: registry.clone(),
            counter: std::sync::OnceLock::new(),
        });
        let in_flight = Arc::new(InFlightCell {
            service: service.to_owned(),
            process_bytes: common.max_in_flight_message_bytes,
            connection_bytes: common.max_in_flight_message_bytes_per_connection,
            registry: registry.clone(),
            budget: std::sync::OnceLock::new(),
        });
        let Some(material) = tls else {
            return Ok(Edge {
                accept_failures: Some(accept_failures),
                oversize_calls: Some(oversize_calls),
                in_flight: Some(in_flight),
                ..Edge::default()
            });
        };
        material.watch(common.tls.tls_reload_interval, shutdown.clone());
        let denied = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                format!("balanceroute_{service}_calls_denied_total"),
                "Calls refused by the method x role table (PERMISSION_DENIED), by reason",
            ),
            &["reason"],
        )?;
        let failures = prometheus::IntCounterVec::new(
            prometheus::Opts::new(
                format!("balanceroute_{service}_tls_handshake_failures_total"),
                "TLS handshakes that failed (no or bad client certificate, plaintext) or timed out",
            ),
            &["reason"],
        )?;
        registry.register(Box::new(denied.clone()))?;
        registry.register(Box::new(failures.clone()))?;
        Ok(Edge {
            tls: Some(material),
            denied: Some(denied),
            handshake_failures: Some(failures),
            accept_failures: Some(accept_failures),
            oversize_calls: Some(oversize_calls),
            in_flight: Some(in_flight),
        })
    }

    /// The process's budget of unfinished request messages (see [`crate::in_flight`]), the
    /// same for every gRPC port and br-decision's HTTP/JSON bodies; `None` for an edge not made
    /// by [`Edge::load`].
    pub fn in_flight_budget(&self) -> Option<Arc<crate::in_flight::InFlightBudget>> {
        Some(self.in_flight.as_ref()?.get())
    }

    /// Counts the gRPC ports' oversize refusals (see [`crate::oversize`]).
    pub fn oversize_hook(&self) -> Option<crate::oversize::OversizeHook> {
        let c = self.oversize_calls.as_ref()?.get()?;
        Some(Arc::new(move || c.inc()))
    }

    /// Counts the accept loop's failures (see [`br_trust::accept`]); for every listener of
    /// the service, so a second port is bounded and counted like `--listen`.
    pub fn accept_hook(&self) -> Option<br_trust::accept::AcceptHook> {
        let c = self.accept_failures.clone()?;
        Some(Arc::new(move |reason| c.with_label_values(&[reason]).inc()))
    }

    /// The TLS material, `None` when serving plaintext on loopback.
    pub fn tls(&self) -> Option<&Arc<br_trust::TlsMaterial>> {
        self.tls.as_ref()
    }

    /// What a TLS listener of this service enforces and counts (its material, the denial and
    /// handshake-failure counters); `None` when serving plaintext. Every listener that takes
    /// calls (gRPC, and br-decision's HTTP/JSON) uses the same, so a refusal is counted once
    /// whichever port it came through.
    pub fn serving(&self) -> Option<crate::serve::TlsServing> {
        let material = self.tls.clone()?;
        let denied = self.denied.clone();
        let failures = self.handshake_failures.clone();
        Some(crate::serve::TlsServing {
            material,
            on_deny: denied.map(|c| -> br_trust::policy::DenyHook {
                Arc::new(move |reason, _msg: &str| c.with_label_values(&[reason.label()]).inc())
            }),
            on_handshake_failure: failures.map(|c| -> br_trust::tls::HandshakeFailureHook {
                Arc::new(move |reason: &str| c.with_label_values(&[reason]).inc())
            }),
        })
    }
}
