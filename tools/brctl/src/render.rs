//! Text output: tables (comfy-table) and a load bar per rank, or JSON (`--output json`).

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{CellAlignment, Table};

use br_proto::v1;

use crate::model::{GroupSummary, RequestRow};

/// Width of the load bar in characters.
pub const BAR_WIDTH: usize = 24;

/// A bar of `load` against `max`, `width` characters wide (full blocks, then spaces).
pub fn bar(load: u64, max: u64, width: usize) -> String {
    let filled = if max == 0 {
        0
    } else {
        // rounded to the nearest cell, and a non-zero load always shows one
        let f = ((load as u128 * width as u128 + max as u128 / 2) / max as u128) as usize;
        f.max(usize::from(load > 0)).min(width)
    };
    format!("{}{}", "█".repeat(filled), "·".repeat(width - filled))
}

fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_header(header.to_vec());
    t
}

/// `brctl status` without a group.
pub fn groups_table(groups: &[v1::GroupSummary]) -> String {
    let mut t = table(&[
        "GROUP", "EPOCH", "VERSION", "WORKERS", "LIVE", "CORDONED", "REQUESTS",
    ]);
    for g in groups {
        t.add_row(vec![
            g.group.clone(),
            g.epoch.to_string(),
            g.version.to_string(),
            g.workers.to_string(),
            g.live_workers.to_string(),
            g.cordoned_workers.to_string(),
            g.requests.to_string(),
        ]);
    }
    right_align_from(&mut t, 1);
    t.to_string()
}

/// The one-line summary above a group's table (it must fit `brctl watch`'s frame). The names
/// are the ones br-sim, the demo and the snapshot service's metrics use: imbalance = max − min
/// load, barrier idle = G·M − ΣL (`brctl status --help` says so).
pub fn group_header(v: &GroupSummary) -> String {
    format!(
        "group {}  epoch {}  version {}  requests {}  tokens: max {}  imbalance {}  barrier idle {} ({:.1}%)",
        v.group,
        v.epoch,
        v.version,
        v.requests,
        v.max_load_tokens,
        v.imbalance_tokens,
        v.barrier_idle_tokens,
        v.barrier_idle_share * 100.0
    )
}

/// The state shown in the STATE column: liveness, and the cordon.
pub fn state_label(liveness: &str, cordoned: bool) -> String {
    if cordoned {
        format!("{liveness},cordoned")
    } else {
        liveness.to_owned()
    }
}

/// `brctl status GROUP`.
pub fn group_table(v: &GroupSummary) -> String {
    let mut t = table(&[
        "WORKER",
        "STATE",
        "INCARNATION",
        "KV LOAD",
        "TOKENS",
        "RUNNING",
        "RESERVED",
        "CAPACITY",
        "ENDPOINT",
    ]);
    for w in &v.workers {
        t.add_row(vec![
            w.worker_id.to_string(),
            state_label(w.liveness, w.cordoned),
            w.incarnation.clone(),
            bar(w.load_tokens, v.max_load_tokens, BAR_WIDTH),
            w.load_tokens.to_string(),
            w.running.to_string(),
            w.reserved.to_string(),
            w.capacity.to_string(),
            w.endpoint.clone(),
        ]);
    }
    for col in [4, 5, 6, 7] {
        if let Some(c) = t.column_mut(col) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    format!("{}\n{t}", group_header(v))
}

/// The decision replicas under `brctl status GROUP --decision-admin …`.
pub fn decision_table(rows: &[crate::model::DecisionRow]) -> String {
    let mut t = table(&["DECISION", "POLICY", "READY", "POOL", "σ VERSION", "STALE"]);
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
    for r in rows {
        if let Some(e) = &r.error {
            t.add_row(vec![r.admin.clone(), format!("unreadable: {e}")]);
            continue;
        }
        t.add_row(vec![
            r.admin.clone(),
            opt(r.policy.clone()),
            opt(r.ready.map(|b| if b { "yes" } else { "no" }.to_owned())),
            opt(r.pool.map(|p| p.to_string())),
            opt(r.sigma_version.map(|v| v.to_string())),
            opt(r.stale.map(|b| if b { "yes" } else { "no" }.to_owned())),
        ]);
    }
    t.to_string()
}

/// `brctl requests GROUP [WORKER]`.
pub fn requests_table(rows: &[RequestRow]) -> String {
    let mut t = table(&[
        "REQUEST",
        "WORKER",
        "PHASE",
        "PROMPT",
        "GENERATED",
        "KV",
        "MAX_TOKENS",
    ]);
    for r in rows {
        t.add_row(vec![
            r.request_id.clone(),
            r.worker_id.to_string(),
            r.phase.to_owned(),
            r.prompt_tokens.to_string(),
            r.generated_tokens.to_string(),
            r.kv_tokens.to_string(),
            r.max_tokens
                .map_or_else(|| "-".to_owned(), |m| m.to_string()),
        ]);
    }
    for col in [1, 3, 4, 5, 6] {
        if let Some(c) = t.column_mut(col) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    t.to_string()
}

fn right_align_from(t: &mut Table, first: usize) {
    let n = t.column_count();
    for col in first..n {
        if let Some(c) = t.column_mut(col) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_scale_to_the_largest_load() {
        assert_eq!(bar(0, 0, 4), "····");
        assert_eq!(bar(10, 10, 4), "████");
        assert_eq!(bar(5, 10, 4), "██··");
        // a small non-zero load still shows
        assert_eq!(bar(1, 1000, 4), "█···");
        assert_eq!(bar(2000, 1000, 4), "████", "never wider than the bar");
    }

    #[test]
    fn the_header_shows_max_imbalance_and_barrier_idle() {
        let v = GroupSummary::of_snapshot(&br_sigma::fixtures::snapshot());
        let h = group_header(&v);
        assert!(
            h.contains("tokens: max 150  imbalance 100  barrier idle 100 (33.3%)"),
            "{h}"
        );
    }
}
