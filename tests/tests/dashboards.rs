//! The Grafana dashboard and the alert rules against what a live stack exports.
//!
//! `deploy/validate.sh` checks that every metric *name* a panel or rule queries is listed in
//! deploy/metrics-contract.txt; that missed panels grouping by labels no service sets (a panel
//! grouped `assign_total` by `policy, outcome` while the metric carries `code`), which draw an
//! empty or single-series graph and never fail. Here the real binaries run with traffic, every
//! `/metrics` page is scraped, and each PromQL expression of the dashboard and of the alert
//! rules is parsed (promql-parser, the Prometheus grammar) and walked: every selector must name
//! a series some service exports, and every label it matches on, groups by (`by`/`without`) or
//! joins on (`on`/`ignoring`/`group_left`) must exist on the series it applies to, or be a
//! target label the Prometheus configuration attaches (`target_label:` in
//! deploy/prometheus/prometheus.yml, plus `job` and `instance`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use br_e2e::{FakeWorker, Service, Split, root};
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::{AssignRequest, CancelRequest};
use br_testkit::eventually_some;
use promql_parser::label::METRIC_NAME;
use promql_parser::parser::token::{T_BOTTOMK, T_LIMIT_RATIO, T_LIMITK, T_TOPK};
use promql_parser::parser::{self, Expr, LabelModifier};
use yaml_rust2::{Yaml, YamlLoader};

const GROUP: &str = "dash";
const START: Duration = Duration::from_secs(60);

/// Every exported series name (as Prometheus stores it: histograms as `_bucket`, `_sum`,
/// `_count`) with the label names its samples carry.
type Exported = BTreeMap<String, BTreeSet<String>>;

/// One query of the dashboard or the rules, named by where it comes from.
struct Query {
    origin: String,
    expr: String,
}

/// Grafana's variables, replaced by values that keep the expression valid PromQL.
fn expand_grafana(expr: &str) -> String {
    expr.replace("$__rate_interval", "5m")
        .replace("$__interval", "1m")
        .replace("$__range", "1h")
        .replace("$namespace", ".*")
        .replace("$group", ".*")
        .replace("$pod", ".*")
}

fn dashboard_queries() -> Vec<Query> {
    let path = root().join("deploy/grafana/balanceroute.json");
    let dash: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).expect("dashboard JSON");
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().expect("panels") {
        let title = panel["title"].as_str().unwrap_or("?");
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                out.push(Query {
                    origin: format!("dashboard panel {title:?}"),
                    expr: expand_grafana(expr),
                });
            }
        }
    }
    // Variables: `label_values(SELECTOR, LABEL)` is Grafana's, not PromQL; it needs the same
    // thing as `group by (LABEL) (SELECTOR)`, which is checked instead.
    for var in dash["templating"]["list"].as_array().into_iter().flatten() {
        // Only query variables run PromQL (a datasource variable's query is a plugin type).
        if var["type"].as_str() != Some("query") {
            continue;
        }
        let query = var["query"]["query"]
            .as_str()
            .or_else(|| var["query"].as_str());
        let Some(query) = query else { continue };
        let name = var["name"].as_str().unwrap_or("?");
        let inner = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .unwrap_or_else(|| panic!("variable {name}: unexpected query {query:?}"));
        let (selector, label) = inner
            .rsplit_once(',')
            .unwrap_or_else(|| panic!("variable {name}: label_values without a label"));
        out.push(Query {
            origin: format!("dashboard variable {name}"),
            expr: expand_grafana(&format!("group by ({}) ({selector})", label.trim())),
        });
    }
    assert!(out.len() >= 10, "the dashboard has {} queries", out.len());
    out
}

fn rule_queries() -> Vec<Query> {
    let path = root().join("deploy/prometheus/alerts.yml");
    let text = std::fs::read_to_string(&path).unwrap();
    let docs = YamlLoader::load_from_str(&text).expect("alerts.yml is YAML");
    let mut out = Vec::new();
    for group in docs[0]["groups"].as_vec().expect("groups") {
        for rule in group["rules"].as_vec().expect("rules") {
            let name = rule["alert"]
                .as_str()
                .or_else(|| rule["record"].as_str())
                .unwrap_or("?");
            let expr = rule["expr"].as_str().expect("every rule has an expr");
            out.push(Query {
                origin: format!("rule {name}"),
                expr: expr.to_owned(),
            });
        }
    }
    assert!(out.len() >= 5, "alerts.yml has {} rules", out.len());
    out
}

/// The labels Prometheus attaches to every scraped series under our scrape configuration.
fn target_labels() -> BTreeSet<String> {
    let path = root().join("deploy/prometheus/prometheus.yml");
    let text = std::fs::read_to_string(&path).unwrap();
    let docs = YamlLoader::load_from_str(&text).expect("prometheus.yml is YAML");
    let mut labels: BTreeSet<String> = ["job", "instance"].map(String::from).into();
    for job in docs[0]["scrape_configs"].as_vec().expect("scrape_configs") {
        for relabel in job["relabel_configs"].as_vec().into_iter().flatten() {
            if let Some(t) = relabel["target_label"].as_str()
                && !t.starts_with("__")
            {
                labels.insert(t.to_owned());
            }
        }
        for sd in job["static_configs"].as_vec().into_iter().flatten() {
            if let Yaml::Hash(h) = &sd["labels"] {
                labels.extend(h.keys().filter_map(Yaml::as_str).map(String::from));
            }
        }
    }
    labels
}

/// Walks an expression; returns the label names its result series can carry, and records every
/// label or series it uses that does not exist.
struct Checker<'a> {
    exported: &'a Exported,
    target: &'a BTreeSet<String>,
    problems: Vec<String>,
}

impl Checker<'_> {
    fn need(&mut self, label: &str, available: &BTreeSet<String>, what: &str) {
        if !available.contains(label) {
            self.problems.push(format!(
                "{what} uses label {label:?}, which the series there do not carry (they have {available:?})"
            ));
        }
    }

    fn walk(&mut self, e: &Expr) -> BTreeSet<String> {
        match e {
            Expr::VectorSelector(vs) => {
                let name = vs.name.clone().or_else(|| {
                    vs.matchers
                        .matchers
                        .iter()
                        .find(|m| m.name == METRIC_NAME)
                        .map(|m| m.value.clone())
                });
                let Some(name) = name else {
                    self.problems.push(format!("selector {e} names no metric"));
                    return self.target.clone();
                };
                let mut available = self.target.clone();
                match self.exported.get(&name) {
                    Some(labels) => available.extend(labels.iter().cloned()),
                    None => {
                        self.problems
                            .push(format!("{name} is not exported by any service"));
                        return available;
                    }
                }
                let matchers = vs
                    .matchers
                    .matchers
                    .iter()
                    .chain(vs.matchers.or_matchers.iter().flatten());
                for m in matchers {
                    if m.name != METRIC_NAME {
                        self.need(&m.name, &available, &format!("selector {e}"));
                    }
                }
                available
            }
            Expr::MatrixSelector(ms) => self.walk(&Expr::VectorSelector(ms.vs.clone())),
            Expr::Aggregate(agg) => {
                let inner = self.walk(&agg.expr);
                if let Some(p) = &agg.param {
                    self.walk(p);
                }
                let keeps_series =
                    [T_TOPK, T_BOTTOMK, T_LIMITK, T_LIMIT_RATIO].contains(&agg.op.id());
                match &agg.modifier {
                    Some(LabelModifier::Include(by)) => {
                        for l in &by.labels {
                            self.need(l, &inner, &format!("`{e}` (by)"));
                        }
                        if keeps_series {
                            inner
                        } else {
                            by.labels.iter().cloned().collect()
                        }
                    }
                    Some(LabelModifier::Exclude(without)) => {
                        for l in &without.labels {
                            self.need(l, &inner, &format!("`{e}` (without)"));
                        }
                        let drop: BTreeSet<&String> = without.labels.iter().collect();
                        inner.into_iter().filter(|l| !drop.contains(l)).collect()
                    }
                    None if keeps_series => inner,
                    None => BTreeSet::new(),
                }
            }
            Expr::Binary(b) => {
                let lhs = self.walk(&b.lhs);
                let rhs = self.walk(&b.rhs);
                let both: BTreeSet<String> = lhs.union(&rhs).cloned().collect();
                if let Some(m) = &b.modifier {
                    if let Some(matching) = &m.matching {
                        for l in &matching.labels().labels {
                            self.need(l, &both, &format!("`{e}` (on/ignoring)"));
                        }
                    }
                    if let Some(extra) = m.card.labels() {
                        for l in &extra.labels {
                            self.need(l, &both, &format!("`{e}` (group_left/right)"));
                        }
                    }
                }
                both
            }
            Expr::Paren(p) => self.walk(&p.expr),
            Expr::Unary(u) => self.walk(&u.expr),
            Expr::Subquery(s) => self.walk(&s.expr),
            Expr::Call(call) => {
                let mut out = BTreeSet::new();
                for arg in &call.args.args {
                    out.extend(self.walk(arg));
                }
                match call.func.name {
                    "label_replace" | "label_join" => {
                        if let Some(Expr::StringLiteral(dst)) = call.args.args.get(1).map(|a| &**a)
                        {
                            out.insert(dst.val.clone());
                        }
                    }
                    "histogram_quantile" => {
                        out.remove("le");
                    }
                    _ => {}
                }
                out
            }
            Expr::NumberLiteral(_) | Expr::StringLiteral(_) | Expr::Extension(_) => BTreeSet::new(),
        }
    }
}

/// Finds every problem in `queries` against `exported`.
fn check(queries: &[Query], exported: &Exported, target: &BTreeSet<String>) -> Vec<String> {
    let mut problems = Vec::new();
    for q in queries {
        let ast = match parser::parse(&q.expr) {
            Ok(ast) => ast,
            Err(e) => {
                problems.push(format!("{}: does not parse: {e}: {}", q.origin, q.expr));
                continue;
            }
        };
        let mut c = Checker {
            exported,
            target,
            problems: Vec::new(),
        };
        c.walk(&ast);
        problems.extend(c.problems.into_iter().map(|p| format!("{}: {p}", q.origin)));
    }
    problems
}

async fn scrape(services: &[&Service]) -> Exported {
    let mut out = Exported::new();
    for s in services {
        let m = br_testkit::http::metrics_url(&s.admin_url("/metrics")).await;
        for sample in &m.samples {
            out.entry(sample.name.clone())
                .or_default()
                .extend(sample.labels.keys().cloned());
        }
    }
    out
}

/// The checker itself catches what it is for: a grouping label no series carries, a metric no
/// service exports, a join on a missing label; and accepts target labels and histogram `le`.
#[test]
fn the_checker_finds_missing_labels_and_metrics() {
    let exported: Exported = [
        ("a_total", &["group", "code"][..]),
        ("lat_seconds_bucket", &["group", "le"][..]),
        ("load", &["group", "worker_id"][..]),
    ]
    .into_iter()
    .map(|(n, ls)| (n.to_owned(), ls.iter().map(|l| (*l).to_owned()).collect()))
    .collect();
    let target: BTreeSet<String> = ["namespace", "pod"].map(String::from).into();
    let q = |expr: &str| Query {
        origin: expr.to_owned(),
        expr: expr.to_owned(),
    };
    let good = [
        q(r#"sum by (code, namespace) (rate(a_total{group=~".*"}[5m]))"#),
        q("histogram_quantile(0.99, sum by (le) (rate(lat_seconds_bucket[5m])))"),
        q("load / ignoring (worker_id) group_left avg by (group) (load)"),
        q("topk(3, load) > 0"),
    ];
    assert_eq!(check(&good, &exported, &target), Vec::<String>::new());
    let bad = [
        q("sum by (policy, outcome) (rate(a_total[5m]))"),
        q("rate(missing_total[5m])"),
        q(r#"load{reason="x"}"#),
        q("sum by (group) (load) / on (worker_id) sum by (group) (a_total)"),
        q("sum(rate(a_total[5m])) by (code"),
    ];
    let problems = check(&bad, &exported, &target);
    for (needle, n) in [
        ("uses label \"policy\"", 1),
        ("uses label \"outcome\"", 1),
        ("missing_total is not exported", 1),
        ("uses label \"reason\"", 1),
        ("uses label \"worker_id\"", 1),
        ("does not parse", 1),
    ] {
        assert_eq!(
            problems.iter().filter(|p| p.contains(needle)).count(),
            n,
            "{needle} in {problems:#?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_and_alert_queries_series_and_labels_a_live_stack_exports() {
    let Split {
        snapshot,
        ingest,
        decision,
    } = Split::start(&["--progress-interval", "100ms"], &["--groups", GROUP]).await;
    let ingest_url = ingest.grpc_url();
    // A shim in front of an engine that is not there: its metrics exist all the same. In a
    // group of its own, so that Assigns go to the fake workers, which run what they get.
    let shim = Service::start(
        "br-shim",
        &[
            "--upstream",
            "http://127.0.0.1:1",
            "--ingest-addr",
            &ingest_url,
            "--group",
            "dash-shim",
            "--worker-id",
            "7",
        ],
    );
    let mut workers = Vec::new();
    for id in 0..2 {
        workers.push(FakeWorker::connect(&ingest_url, GROUP, id, 4).await);
    }
    decision.wait_for("/readyz", START).await;
    shim.wait_for("/livez", START).await;

    // Traffic: answered Assigns that run, step and finish, and a cancel.
    let d = DecisionClient::connect(decision.grpc_url()).await.unwrap();
    for i in 0..4 {
        // The first answers wait until decision's σ has the workers LIVE (UNAVAILABLE before);
        // a retry keeps the request id, so it is never placed twice.
        let a = eventually_some(
            Duration::from_secs(20),
            "an Assign answered once the workers are LIVE",
            || {
                let mut d = d.clone();
                async move {
                    let mut req = tonic::Request::new(AssignRequest {
                        group: GROUP.into(),
                        request_id: format!("r{i}"),
                        prompt_tokens: 100 + i,
                        prompt_hash: None,
                        max_tokens: None,
                        expected_output_tokens: None,
                        request_class: None,
                    });
                    req.set_timeout(Duration::from_secs(10));
                    match d.assign(req).await {
                        Ok(a) => Some(a.into_inner()),
                        Err(s) if s.code() == tonic::Code::Unavailable => None,
                        Err(s) => panic!("Assign r{i}: {s}"),
                    }
                }
            },
        )
        .await;
        let w = workers
            .iter_mut()
            .find(|w| w.worker_id == a.worker_id)
            .expect("assigned to a connected worker");
        w.start(&format!("r{i}"), 100 + i).await;
        w.step(3).await;
    }
    workers[0].finish("r0").await;
    workers[1].finish("r1").await;
    let _ = d
        .clone()
        .cancel(CancelRequest {
            group: GROUP.into(),
            request_id: "never-assigned".into(),
        })
        .await;

    let services = [&snapshot, &ingest, &decision, &shim];
    // Scrape once the load per worker is in σ (the snapshot's gauges are per worker).
    let exported = eventually_some(
        Duration::from_secs(20),
        "the snapshot service exports per-worker loads",
        || async {
            let e = scrape(&services).await;
            e.contains_key("balanceroute_snapshot_worker_load_tokens")
                .then_some(e)
        },
    )
    .await;

    let mut queries = dashboard_queries();
    queries.extend(rule_queries());
    let problems = check(&queries, &exported, &target_labels());
    assert!(
        problems.is_empty(),
        "{} problems in deploy/ queries against the live stack:\n{}",
        problems.len(),
        problems.join("\n")
    );
}
