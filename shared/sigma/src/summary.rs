//! What an operator sees of one group's σ: per rank its state, KV load and request counts,
//! and the group's barrier numbers: M, the imbalance max − min L, the barrier idle
//! I = G·M − ΣL (the paper's I) and its share of the barrier's work. The names are the ones
//! br-sim, br-emu, the demo and the snapshot service's metrics use (`imbalance_tokens`,
//! `barrier_idle_tokens`). One computation for every viewer: brctl builds it from the `ClusterSnapshot`
//! that `Snapshot.Get` answers ([`GroupSummary::of_snapshot`]), br-decision's live page from
//! its replica ([`Sigma::summary`], O(ranks): the loads come from the routing core's
//! per-worker sums, not from a walk over the requests). The two agree on every σ (the property
//! test of this crate checks it after every batch).

use br_proto::v1;
use serde::{Serialize, Serializer};

use crate::types::Liveness;
use crate::{Sigma, Worker};

/// One rank as `brctl status GROUP` and the live page show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WorkerSummary {
    pub worker_id: u32,
    /// live | suspect | fenced.
    pub liveness: &'static str,
    pub cordoned: bool,
    /// Hex, as the services log it.
    pub incarnation: String,
    /// KV tokens of its requests in σ (a reservation counts its prompt only).
    pub load_tokens: u64,
    pub running: u32,
    pub reserved: u32,
    pub capacity: u32,
    pub endpoint: String,
    /// The ingest replica carrying its telemetry.
    pub carrier: String,
}

/// A 64-bit integer as a decimal string in JSON. A browser reads JSON numbers as doubles,
/// which hold 53 bits: σ's epoch (a random 64-bit number) lost its low bits on the live page.
/// br-decision's HTTP API answers 64-bit integers the same way (proto3's JSON mapping), and
/// brctl prints them in decimal, so every viewer shows the same digits.
pub fn decimal<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// [`decimal`], `null` for `None`.
pub fn decimal_opt<S: Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => s.collect_str(v),
        None => s.serialize_none(),
    }
}

/// One group as `brctl status GROUP` and the live page show it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupSummary {
    pub group: String,
    /// A decimal string in JSON ([`decimal`]).
    #[serde(serialize_with = "decimal")]
    pub epoch: u64,
    /// A decimal string in JSON ([`decimal`]).
    #[serde(serialize_with = "decimal")]
    pub version: u64,
    /// Sorted by worker id.
    pub workers: Vec<WorkerSummary>,
    pub requests: usize,
    /// M: the largest load over ranks that are not fenced (the lockstep barrier waits for it).
    pub max_load_tokens: u64,
    /// The imbalance max − min L over ranks that are not fenced.
    pub imbalance_tokens: u64,
    /// The barrier idle I = G·M − Σ L over ranks that are not fenced: the KV-token slots idle
    /// waiting on the slowest rank (the paper's I).
    pub barrier_idle_tokens: u64,
    /// I / (G·M): the share of the barrier's KV work that is idle waiting on the slowest rank
    /// (0 when all ranks are equal, or when there is no load).
    pub barrier_idle_share: f64,
}

impl Liveness {
    /// The lower-case name viewers print (`live`, `suspect`, `fenced`).
    pub fn name(self) -> &'static str {
        match self {
            Liveness::Live => "live",
            Liveness::Suspect => "suspect",
            Liveness::Fenced => "fenced",
        }
    }
}

/// The name of a wire liveness; UNSPECIFIED and unknown values are FENCED, as the contract
/// says.
pub fn liveness_name(v: i32) -> &'static str {
    Liveness::from_wire(v).name()
}

fn is_reserved(r: &v1::RequestState) -> bool {
    r.state == v1::RequestPhase::Reserved as i32
}

/// A request's KV load as σ counts it: a reservation its prompt, an active request prompt +
/// generated.
pub fn kv_tokens(r: &v1::RequestState) -> u64 {
    let generated = if is_reserved(r) {
        0
    } else {
        r.generated_tokens
    };
    u64::from(r.prompt_tokens) + u64::from(generated)
}

impl GroupSummary {
    /// The summary of a snapshot as `Snapshot.Get` answers it. Loads are recomputed from the
    /// requests (`WorkerState.load_tokens` is informative only, as types.proto says); a
    /// request naming a worker the snapshot does not list is left out.
    pub fn of_snapshot(snap: &v1::ClusterSnapshot) -> GroupSummary {
        let mut workers: Vec<WorkerSummary> = snap
            .workers
            .iter()
            .map(|w| WorkerSummary {
                worker_id: w.worker_id,
                liveness: liveness_name(w.liveness),
                cordoned: w.cordoned,
                incarnation: format!("{:016x}", w.incarnation),
                load_tokens: 0,
                running: 0,
                reserved: 0,
                capacity: w.capacity,
                endpoint: w.endpoint.clone(),
                carrier: w.carrier.clone(),
            })
            .collect();
        workers.sort_by_key(|w| w.worker_id);
        for r in &snap.requests {
            let Ok(i) = workers.binary_search_by_key(&r.worker_id, |w| w.worker_id) else {
                continue;
            };
            let w = &mut workers[i];
            w.load_tokens += kv_tokens(r);
            if is_reserved(r) {
                w.reserved += 1;
            } else {
                w.running += 1;
            }
        }
        GroupSummary::of_rows(
            &snap.group,
            snap.epoch,
            snap.version,
            workers,
            snap.requests.len(),
        )
    }

    /// The barrier numbers over `workers` (sorted by id): the one place they are computed.
    fn of_rows(
        group: &str,
        epoch: u64,
        version: u64,
        workers: Vec<WorkerSummary>,
        requests: usize,
    ) -> GroupSummary {
        let alive = || workers.iter().filter(|w| w.liveness != "fenced");
        let max = alive().map(|w| w.load_tokens).max().unwrap_or(0);
        let min = alive().map(|w| w.load_tokens).min().unwrap_or(0);
        let sum: u64 = alive().map(|w| w.load_tokens).sum();
        let barrier = alive().count() as u64 * max;
        let idle = barrier - sum;
        GroupSummary {
            group: group.to_owned(),
            epoch,
            version,
            workers,
            requests,
            max_load_tokens: max,
            imbalance_tokens: max - min,
            barrier_idle_tokens: idle,
            barrier_idle_share: if barrier == 0 {
                0.0
            } else {
                idle as f64 / barrier as f64
            },
        }
    }
}

impl Sigma {
    /// The summary of this σ, equal to [`GroupSummary::of_snapshot`] of its
    /// [`to_snapshot`](Sigma::to_snapshot), in O(ranks): loads and counts are the routing
    /// core's per-worker sums, which every change keeps in step.
    pub fn summary(&self) -> GroupSummary {
        let workers = self
            .workers()
            .map(|w: &Worker| {
                let core = self.cluster().worker(w.id);
                WorkerSummary {
                    worker_id: w.id,
                    liveness: w.liveness.name(),
                    cordoned: w.cordoned,
                    incarnation: format!("{:016x}", w.incarnation),
                    load_tokens: core.map_or(0, |c| c.load()),
                    running: core.map_or(0, |c| c.running),
                    reserved: core.map_or(0, |c| c.queued),
                    capacity: w.capacity,
                    endpoint: w.endpoint.clone(),
                    carrier: w.carrier.clone(),
                }
            })
            .collect();
        GroupSummary::of_rows(
            self.group(),
            self.epoch(),
            self.version(),
            workers,
            self.request_count(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::fixtures::snapshot;

    #[test]
    fn loads_counts_and_the_barrier_follow_the_requests() {
        let v = GroupSummary::of_snapshot(&snapshot());
        let ids: Vec<u32> = v.workers.iter().map(|w| w.worker_id).collect();
        assert_eq!(ids, vec![0, 1, 2]);
        let w0 = &v.workers[0];
        assert_eq!((w0.load_tokens, w0.running, w0.reserved), (150, 1, 1));
        assert_eq!(w0.incarnation, "00000000000000ab");
        assert_eq!(
            (v.workers[1].liveness, v.workers[2].liveness),
            ("suspect", "fenced")
        );
        // the fenced rank is out of the barrier: G = 2, M = 150, min 50, Σ = 200
        assert_eq!(
            (v.max_load_tokens, v.imbalance_tokens, v.barrier_idle_tokens),
            (150, 100, 100)
        );
        assert!((v.barrier_idle_share - 100.0 / 300.0).abs() < 1e-12);
    }

    #[test]
    fn imbalance_is_max_minus_min_and_barrier_idle_is_g_max_minus_sum() {
        use crate::fixtures::{request, worker};
        // three live ranks at 0, 10 and 30 tokens: the two figures differ once G > 2
        let snap = v1::ClusterSnapshot {
            group: "g".into(),
            workers: (0..3).map(|id| worker(id, v1::Liveness::Live)).collect(),
            requests: vec![request("a", 1, 10, 0, false), request("b", 2, 30, 0, false)],
            ..Default::default()
        };
        let v = GroupSummary::of_snapshot(&snap);
        assert_eq!(v.max_load_tokens, 30);
        assert_eq!(v.imbalance_tokens, 30);
        assert_eq!(v.barrier_idle_tokens, 3 * 30 - 40);
        assert!((v.barrier_idle_share - 50.0 / 90.0).abs() < 1e-12);
    }

    #[test]
    fn an_empty_group_has_no_idle_share() {
        let v = GroupSummary::of_snapshot(&v1::ClusterSnapshot {
            group: "g".into(),
            ..Default::default()
        });
        assert_eq!(
            (
                v.imbalance_tokens,
                v.barrier_idle_tokens,
                v.barrier_idle_share
            ),
            (0, 0, 0.0)
        );
        assert_eq!(Sigma::new("g").summary(), v);
    }

    #[test]
    fn a_replica_summarises_as_its_snapshot_does() {
        let snap = snapshot();
        let s = Sigma::from_snapshot(&snap).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.summary(), GroupSummary::of_snapshot(&s.to_snapshot()));
        assert_eq!(s.summary(), GroupSummary::of_snapshot(&snap));
    }
}
