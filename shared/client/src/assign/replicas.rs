//! The replica set behind an [`AssignClient`]: each replica's connection and health (ejection
//! after failures, one probe when its time is up), the DNS names re-resolved into replicas,
//! and the order a call tries them in ([`Selection`]).
//!
//! Separate from the client's call loop: which replica a call goes to, and when one is
//! skipped, reads on its own.

use super::*;

/// One decision replica: its connection and what the calls through it have shown.
#[derive(Debug)]
pub(super) struct Replica {
    pub(super) addr: String,
    pub(super) client: DecisionClient<br_trace::Traced<Channel>>,
    pub(super) health: Mutex<Health>,
}

#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Health {
    /// Failed attempts since the last success.
    failures: u32,
    /// Skipped until then (None: healthy).
    pub(super) down_until: Option<Instant>,
}

impl Replica {
    pub(super) fn new(addr: String, channel: Channel) -> Replica {
        Replica {
            addr,
            // each Assign carries the caller's trace context (when tracing is on)
            client: DecisionClient::new(br_trace::traced(channel)),
            health: Mutex::new(Health::default()),
        }
    }

    pub(super) fn health(&self) -> Health {
        // A poisoned lock only means a panic elsewhere; the data is two plain numbers.
        *self.health.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn update(&self, f: impl FnOnce(&mut Health)) {
        f(&mut self.health.lock().unwrap_or_else(|e| e.into_inner()));
    }

    pub(super) fn succeeded(&self) {
        self.update(|h| *h = Health::default());
    }

    pub(super) fn failed(&self, now: Instant) {
        self.update(|h| {
            h.failures = h.failures.saturating_add(1);
            h.down_until = Some(now + ejection(h.failures));
        });
    }

    /// Takes the replica for one call if it is healthy, or if its time out is up (then this
    /// call is the probe, and the others keep skipping it until the probe fails or succeeds).
    fn try_take(&self, now: Instant) -> bool {
        let mut h = self.health.lock().unwrap_or_else(|e| e.into_inner());
        match h.down_until {
            None => true,
            Some(t) if t <= now => {
                h.down_until = Some(now + ejection(h.failures));
                true
            }
            Some(_) => false,
        }
    }
}

/// How long a replica with `failures` consecutive failures is skipped.
fn ejection(failures: u32) -> Duration {
    br_backoff::ceiling(FIRST_EJECTION, MAX_EJECTION, failures.saturating_sub(1))
}

/// A DNS name that stands for every address it resolves to.
#[derive(Debug)]
pub(super) struct DnsTarget {
    /// As given (for messages).
    pub(super) addr: String,
    pub(super) scheme: String,
    pub(super) host: String,
    pub(super) port: u16,
}

/// The replicas: the fixed addresses, plus the current resolution of the DNS names.
#[derive(Debug)]
pub(super) struct Replicas {
    pub(super) fixed: Vec<Arc<Replica>>,
    pub(super) dns: Vec<DnsTarget>,
    pub(super) resolved: RwLock<Resolved>,
    /// One resolution at a time; the others use the current list meanwhile.
    pub(super) resolving: tokio::sync::Mutex<()>,
    pub(super) options: ClientOptions,
    pub(super) tls: Option<Arc<br_trust::TlsMaterial>>,
    /// Round-robin position.
    pub(super) next: AtomicUsize,
}

#[derive(Debug, Default)]
pub(super) struct Resolved {
    pub(super) list: Arc<Vec<Arc<Replica>>>,
    pub(super) at: Option<Instant>,
    pub(super) error: Option<String>,
}

impl Replicas {
    /// The current list of replicas, resolving the DNS names first if that is due.
    pub(super) async fn current(&self) -> Result<Arc<Vec<Arc<Replica>>>, AssignError> {
        if self.dns.is_empty() {
            // Built once at construction and never changed.
            return Ok(self.read().list.clone());
        }
        let due = {
            let r = self.read();
            r.at.is_none_or(|at| at.elapsed() >= self.options.dns_refresh)
                .then_some(r.list.is_empty())
        };
        if let Some(empty) = due {
            // Without any address yet every caller waits for the resolution; otherwise one
            // resolves and the rest go on with the list they have.
            let guard = if empty {
                Some(self.resolving.lock().await)
            } else {
                self.resolving.try_lock().ok()
            };
            if guard.is_some() {
                let stale = self
                    .read()
                    .at
                    .is_none_or(|at| at.elapsed() >= self.options.dns_refresh);
                if stale {
                    self.resolve().await;
                }
            }
        }
        let r = self.read();
        if r.list.is_empty() {
            return Err(AssignError::Unavailable {
                message: format!(
                    "no decision replica: {}",
                    r.error.as_deref().unwrap_or("no address resolved")
                ),
                attempts: 0,
            });
        }
        Ok(r.list.clone())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Resolved> {
        self.resolved.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Resolves every DNS name; keeps the replicas (connections, health) of addresses that
    /// stay, adds new ones, drops gone ones. A failed resolution keeps the last good list.
    pub(super) async fn resolve(&self) {
        let old = self.read().list.clone();
        let mut found: Vec<String> = Vec::new();
        let mut errors = Vec::new();
        for t in &self.dns {
            let lookup = tokio::net::lookup_host((t.host.as_str(), t.port));
            match tokio::time::timeout(self.options.connect_timeout, lookup).await {
                Ok(Ok(addrs)) => {
                    let mut addrs: Vec<SocketAddr> = addrs.collect();
                    addrs.sort();
                    addrs.dedup();
                    found.extend(addrs.into_iter().map(|a| format!("{}://{a}", t.scheme)));
                }
                Ok(Err(e)) => errors.push(format!("resolving {}: {e}", t.addr)),
                Err(_) => errors.push(format!("resolving {}: timed out", t.addr)),
            }
        }
        let mut list: Vec<Arc<Replica>> = self.fixed.clone();
        if errors.is_empty() || !found.is_empty() {
            for addr in found {
                if list.iter().any(|r| r.addr == addr) {
                    continue;
                }
                let kept = old.iter().find(|r| r.addr == addr).cloned();
                let replica = match kept {
                    Some(r) => r,
                    None => match channel(&addr, &self.options, self.tls.as_ref()) {
                        Ok(ch) => Arc::new(Replica::new(addr, ch)),
                        Err(e) => {
                            errors.push(e.to_string());
                            continue;
                        }
                    },
                };
                list.push(replica);
            }
        } else {
            // Nothing resolved at all: keep what was there (a DNS hiccup must not drop replicas
            // that still answer).
            list = old.to_vec();
            if list.is_empty() {
                list = self.fixed.clone();
            }
        }
        if !errors.is_empty() {
            tracing::warn!(errors = ?errors, "resolving the decision replicas");
        }
        let mut w = self.resolved.write().unwrap_or_else(|e| e.into_inner());
        w.list = Arc::new(list);
        w.at = Some(Instant::now());
        w.error = (!errors.is_empty()).then(|| errors.join("; "));
    }

    /// The replica for the next attempt of a call that already tried `tried` (indices into
    /// `list`): a healthy (or due for a probe) one it has not tried, in the order of the
    /// selection; else the untried one back soonest. None: every replica was tried.
    pub(super) fn pick(
        &self,
        list: &[Arc<Replica>],
        tried: &[bool],
        now: Instant,
    ) -> Option<usize> {
        let n = list.len();
        let start = match self.options.selection {
            Selection::Ordered => 0,
            Selection::RoundRobin => self.next.fetch_add(1, Ordering::Relaxed) % n.max(1),
        };
        let order = (0..n).map(|i| (start + i) % n);
        if let Some(i) = order.clone().find(|&i| !tried[i] && list[i].try_take(now)) {
            return Some(i);
        }
        // Every untried replica is down: try the one that is back soonest rather than none.
        order
            .filter(|&i| !tried[i])
            .min_by_key(|&i| list[i].health().down_until)
    }
}

/// The endpoint for one replica address, with the failover-minded connection settings.
/// `https://` is dialled as `http://` when `tls` makes the connection's TLS, and refused with
/// advice when it does not (see [`br_trust::address`]).
pub(super) fn endpoint(addr: &str, o: &ClientOptions, tls: bool) -> Result<Endpoint, AssignError> {
    let ep = br_trust::address::endpoint(addr, tls).map_err(|e| AssignError::BadAddress {
        addr: addr.to_owned(),
        detail: match e {
            br_trust::address::EndpointError::Uri { source, .. } => source.to_string(),
            e => e.to_string(),
        },
    })?;
    Ok(ep
        .tcp_nodelay(true)
        .connect_timeout(o.connect_timeout)
        .http2_keep_alive_interval(o.keepalive_interval)
        .keep_alive_timeout(o.keepalive_timeout)
        .keep_alive_while_idle(true))
}

/// A lazily connecting channel to one replica (mutual TLS with `tls`, verifying the decision
/// role).
pub(super) fn channel(
    addr: &str,
    o: &ClientOptions,
    tls: Option<&Arc<br_trust::TlsMaterial>>,
) -> Result<Channel, AssignError> {
    let ep = endpoint(addr, o, tls.is_some())?;
    Ok(br_trust::tls::connect_lazy(
        ep,
        tls,
        Some(br_trust::Role::Decision),
    ))
}
