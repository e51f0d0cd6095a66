//! `GET /stats` (the engine's configuration and per-step loads, from a step index on) and
//! `POST /stats/reset`.
//!
//! Separate from the OpenAI endpoints: this is the emulator's own measuring interface, which
//! `br-emu load` and the tests read.

use super::*;

#[derive(Debug, Deserialize)]
pub(super) struct StatsQuery {
    /// Only steps from this index on.
    #[serde(default)]
    since: Option<u64>,
    /// Include the per-rank loads of every step.
    #[serde(default)]
    loads: Option<bool>,
}

/// `GET /stats`: the engine's configuration and its per-step loads.
#[derive(Debug, Serialize, Deserialize, Clone, Default)]
pub struct Stats {
    pub ranks: usize,
    pub slots: usize,
    pub a_ms_per_token: f64,
    pub b_ms: f64,
    /// c: ms per running request on the busiest rank (0 for the two-term model).
    #[serde(default)]
    pub c_ms_per_request: f64,
    /// p: ms per prompt token prefilled by the rank that prefills the most (colocated only).
    #[serde(default)]
    pub p_ms_per_prefill_token: f64,
    /// Colocated prefill's budget per rank per step; absent for a decode tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_chunk: Option<u32>,
    pub time_scale: f64,
    /// Index of the first step listed.
    pub first_step: u64,
    /// Steps listed.
    pub steps: usize,
    pub max_load: Vec<u64>,
    pub min_load: Vec<u64>,
    pub sum_load: Vec<u64>,
    /// The most running requests on one rank per step (with `max_load` and a step time, a
    /// `br-sim calibrate` sample).
    #[serde(default)]
    pub max_running: Vec<u32>,
    /// The most prompt tokens one rank prefilled, per step (colocated only; else all 0).
    #[serde(default)]
    pub max_prefill: Vec<u64>,
    /// Model step time a·max L + p·max P + c·max n + b per step, ms.
    pub model_ms: Vec<f64>,
    /// Wall-clock step time per step, ms.
    pub wall_ms: Vec<f64>,
    /// The balance ratio per step: `Σ_g work_g / (G · max_g work_g)`, `work_g = a·L_g + p·P_g
    /// + c·n_g` (br-sim's `balance%`). Absent from engines that did not report it.
    #[serde(default)]
    pub balance: Vec<f64>,
    /// Per step, each rank's load (only with `?loads=true`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loads: Vec<Vec<u64>>,
    /// Requests each rank accepted since start (or the last reset), whichever port they came
    /// through.
    #[serde(default)]
    pub requests_per_rank: Vec<u64>,
    /// Time to first token of each request whose first token came in the steps listed, in
    /// model ms from its arrival at the engine (queue, prefill and that step), in order.
    #[serde(default)]
    pub ttft_model_ms: Vec<f64>,
}

impl Stats {
    /// The paper's imbalance metric: mean over steps of max_g L_g − min_g L_g (KV tokens).
    pub fn mean_max_minus_min(&self) -> f64 {
        if self.steps == 0 {
            return 0.0;
        }
        let s: u64 = self
            .max_load
            .iter()
            .zip(&self.min_load)
            .map(|(a, b)| a - b)
            .sum();
        s as f64 / self.steps as f64
    }

    /// Mean of I(k) = G·max L − Σ L (idle token-slots at the barrier).
    pub fn mean_idle_tokens(&self) -> f64 {
        if self.steps == 0 {
            return 0.0;
        }
        let g = self.ranks as u64;
        let s: u64 = self
            .max_load
            .iter()
            .zip(&self.sum_load)
            .map(|(m, sum)| g * m - sum)
            .sum();
        s as f64 / self.steps as f64
    }

    /// Mean over steps of the balance ratio (br-sim's `avg_balance`, printed as `balance%`);
    /// `None` from an engine that did not list it for every step.
    pub fn mean_balance(&self) -> Option<f64> {
        if self.balance.len() != self.steps {
            return None;
        }
        if self.steps == 0 {
            return Some(0.0);
        }
        Some(self.balance.iter().sum::<f64>() / self.steps as f64)
    }

    /// Mean model step time, ms.
    pub fn mean_model_ms(&self) -> f64 {
        if self.steps == 0 {
            return 0.0;
        }
        self.model_ms.iter().sum::<f64>() / self.steps as f64
    }
}

pub(super) async fn stats(State(s): State<AppState>, Query(q): Query<StatsQuery>) -> Response {
    let ranks = s.engine.ranks();
    let out = s.engine.with_stats(|log| {
        let skip = q
            .since
            .map_or(0, |k| k.saturating_sub(log.first_step) as usize)
            .min(log.steps());
        let loads = if q.loads.unwrap_or(false) {
            log.loads[skip * ranks..]
                .chunks(ranks.max(1))
                .map(<[u64]>::to_vec)
                .collect()
        } else {
            Vec::new()
        };
        Stats {
            ranks,
            slots: s.cfg.slots,
            a_ms_per_token: s.cfg.a_ms_per_token,
            b_ms: s.cfg.b_ms,
            c_ms_per_request: s.cfg.c_ms_per_request,
            p_ms_per_prefill_token: s.cfg.p_ms_per_prefill_token,
            prefill_chunk: s.cfg.prefill_chunk,
            time_scale: s.cfg.time_scale,
            first_step: log.first_step + skip as u64,
            steps: log.steps() - skip,
            max_load: log.max_load[skip..].to_vec(),
            min_load: log.min_load[skip..].to_vec(),
            sum_load: log.sum_load[skip..].to_vec(),
            max_running: log.max_running[skip..].to_vec(),
            max_prefill: log.max_prefill[skip..].to_vec(),
            model_ms: log.model_ms[skip..].to_vec(),
            wall_ms: log.wall_ms[skip..].to_vec(),
            balance: log.balance[skip..].to_vec(),
            loads,
            ttft_model_ms: {
                let from = log.first_step + skip as u64;
                let at = log.ttft_step.partition_point(|&k| k < from);
                log.ttft_model_ms[at..].to_vec()
            },
            requests_per_rank: s
                .per_rank
                .iter()
                .map(|n| n.load(Ordering::Relaxed))
                .collect(),
        }
    });
    axum::Json(out).into_response()
}

pub(super) async fn stats_reset(State(s): State<AppState>) -> StatusCode {
    s.engine.with_stats(|log| log.reset());
    for n in s.per_rank.iter() {
        n.store(0, Ordering::Relaxed);
    }
    StatusCode::NO_CONTENT
}
