//! What brctl shows, computed from σ alone (pure, so it is unit-tested without a server):
//! the request list, and each decision replica's row read off its `/metrics`. The per-rank
//! load, counts and liveness and the group's imbalance, barrier idle and its share are
//! [`GroupSummary`], br-sigma's, which br-decision's live page shows as well.

use br_proto::v1;
pub use br_sigma::summary::{GroupSummary, kv_tokens};
use serde::Serialize;

fn is_reserved(r: &v1::RequestState) -> bool {
    r.state == v1::RequestPhase::Reserved as i32
}

/// One request as `brctl requests` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestRow {
    pub request_id: String,
    pub worker_id: u32,
    /// reserved | active.
    pub phase: &'static str,
    pub prompt_tokens: u32,
    pub generated_tokens: u32,
    pub kv_tokens: u64,
    pub max_tokens: Option<u32>,
}

/// The group's requests, optionally of one rank, sorted by rank then id.
pub fn request_rows(snap: &v1::ClusterSnapshot, worker: Option<u32>) -> Vec<RequestRow> {
    let mut rows: Vec<RequestRow> = snap
        .requests
        .iter()
        .filter(|r| worker.is_none_or(|w| r.worker_id == w))
        .map(|r| RequestRow {
            request_id: r.request_id.clone(),
            worker_id: r.worker_id,
            phase: if is_reserved(r) { "reserved" } else { "active" },
            prompt_tokens: r.prompt_tokens,
            generated_tokens: r.generated_tokens,
            kv_tokens: kv_tokens(r),
            max_tokens: r.max_tokens,
        })
        .collect();
    rows.sort_by(|a, b| (a.worker_id, &a.request_id).cmp(&(b.worker_id, &b.request_id)));
    rows
}

/// Requests σ holds on `worker` (what a drain waits to reach zero).
pub fn requests_on(snap: &v1::ClusterSnapshot, worker: u32) -> usize {
    snap.requests
        .iter()
        .filter(|r| r.worker_id == worker)
        .count()
}

/// One decision replica's view of a group, read off its `/metrics` (`brctl status GROUP
/// --decision-admin URL`). A field is `None` when the replica does not export it (an older
/// version, or a group it does not serve).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DecisionRow {
    /// The admin URL it was read from.
    pub admin: String,
    pub policy: Option<String>,
    /// Whether the replica can place a request (its `/readyz`).
    pub ready: Option<bool>,
    /// Assigns waiting in its pool for this group.
    pub pool: Option<u64>,
    /// The σ version its replica holds.
    pub sigma_version: Option<u64>,
    /// Whether its σ is stale (the snapshot service unreachable).
    pub stale: Option<bool>,
    /// Why it could not be read.
    pub error: Option<String>,
}

/// One sample of the Prometheus text format: name, labels, value.
type Sample = (String, Vec<(String, String)>, f64);

/// Parses the Prometheus text exposition format (what every service's `/metrics` serves):
/// comments skipped, label values unescaped (`\"`, `\\`, `\n`), timestamps ignored. Lines that do
/// not parse are skipped: brctl shows what it can.
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(parse_sample)
        .collect()
}

fn parse_sample(line: &str) -> Option<Sample> {
    let name_end = line.find(['{', ' '])?;
    let name = line[..name_end].to_owned();
    let mut labels = Vec::new();
    let mut rest = &line[name_end..];
    if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.char_indices();
        loop {
            // key="value", ... }
            let (start, c) = chars.next()?;
            if c == '}' {
                rest = &body[start + 1..];
                break;
            }
            if c == ',' || c == ' ' {
                continue;
            }
            let eq = body[start..].find('=')? + start;
            let key = body[start..eq].to_owned();
            // skip to the opening quote
            for (i, c) in chars.by_ref() {
                if i > eq && c == '"' {
                    break;
                }
            }
            let mut value = String::new();
            loop {
                match chars.next()? {
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        other => value.push(other),
                    },
                    (_, '"') => break,
                    (_, c) => value.push(c),
                }
            }
            labels.push((key, value));
        }
    }
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some((name, labels, value))
}

fn label<'a>(labels: &'a [(String, String)], key: &str) -> Option<&'a str> {
    labels
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

const READY: &str = "balanceroute_decision_ready";
const POLICY: &str = "balanceroute_decision_policy_info";
const POOL: &str = "balanceroute_decision_pool_size";
const SIGMA_VERSION: &str = "balanceroute_decision_sigma_version";
const SIGMA_STALE: &str = "balanceroute_decision_sigma_stale";

/// The metric families [`decision_row`] reads: brctl asks a replica's `/metrics` for these
/// alone (`?name[]=`), where the whole page holds some 80 series per group.
pub const DECISION_FAMILIES: [&str; 5] = [READY, POLICY, POOL, SIGMA_VERSION, SIGMA_STALE];

/// What a decision replica's metrics say about `group`.
pub fn decision_row(admin: &str, metrics: &str, group: &str) -> DecisionRow {
    let mut row = DecisionRow {
        admin: admin.to_owned(),
        ..DecisionRow::default()
    };
    for (name, labels, value) in parse_metrics(metrics) {
        let of_group = label(&labels, "group") == Some(group);
        match name.as_str() {
            READY => row.ready = Some(value >= 1.0),
            POLICY if of_group && value >= 1.0 => {
                row.policy = label(&labels, "policy").map(str::to_owned);
            }
            POOL if of_group => row.pool = Some(value as u64),
            SIGMA_VERSION if of_group => row.sigma_version = Some(value as u64),
            SIGMA_STALE if of_group => row.stale = Some(value >= 1.0),
            _ => {}
        }
    }
    row
}

#[cfg(test)]
mod tests {
    use super::*;

    use br_sigma::fixtures::snapshot;

    #[test]
    fn requests_filter_by_rank_and_sort() {
        let s = snapshot();
        let all: Vec<String> = request_rows(&s, None)
            .into_iter()
            .map(|r| r.request_id)
            .collect();
        assert_eq!(all, vec!["a", "b", "c"]);
        let on0 = request_rows(&s, Some(0));
        assert_eq!(on0.len(), 2);
        assert_eq!((on0[0].phase, on0[0].kv_tokens), ("reserved", 30));
        assert_eq!((requests_on(&s, 1), requests_on(&s, 7)), (1, 0));
    }
    #[test]
    fn metrics_text_parses_with_escapes_and_without_labels() {
        let text = "# HELP x y\n# TYPE x gauge\nbalanceroute_decision_ready 1\n\
            balanceroute_decision_pool_size{group=\"g\\\"1\"} 7 1700000000\n\
            balanceroute_decision_pool_size{group=\"g\"} 3\n\
            not a sample\n";
        let s = parse_metrics(text);
        assert_eq!(s.len(), 3, "{s:?}");
        assert_eq!(s[0], ("balanceroute_decision_ready".into(), vec![], 1.0));
        assert_eq!(s[1].1, vec![("group".into(), "g\"1".into())]);
        assert_eq!(s[1].2, 7.0);
    }

    #[test]
    fn a_decision_row_reads_its_group_only() {
        let text = "balanceroute_decision_ready 1\n\
            balanceroute_decision_policy_info{group=\"a\",policy=\"br0\"} 1\n\
            balanceroute_decision_policy_info{group=\"b\",policy=\"jsq\"} 1\n\
            balanceroute_decision_pool_size{group=\"a\"} 4\n\
            balanceroute_decision_pool_size{group=\"b\"} 9\n\
            balanceroute_decision_sigma_version{group=\"a\"} 120\n\
            balanceroute_decision_sigma_stale{group=\"a\"} 0\n";
        let r = decision_row("http://d:9063", text, "a");
        assert_eq!(r.policy.as_deref(), Some("br0"));
        assert_eq!(
            (r.ready, r.pool, r.sigma_version, r.stale),
            (Some(true), Some(4), Some(120), Some(false))
        );
        let none = decision_row("http://d:9063", text, "c");
        assert_eq!((none.policy, none.pool), (None, None));
    }
}
