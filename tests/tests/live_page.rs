//! br-decision's live page in headless Chromium, against the real br-snapshot,
//! br-ingest and br-decision processes with fake workers under Assign traffic.
//!
//! The page is loaded by Debian's `chromium` (installed by `scripts/install-browser.sh`) as a
//! person's browser would: headless, running the page's script, which fetches the JSON and
//! draws the table, for a few seconds of the page's time (`--virtual-time-budget`), after
//! which Chromium prints the DOM (`--dump-dom`) or takes a screenshot (`--screenshot`). The test
//! waits, loading the page again until a timeout, until every rank's row shows a load above
//! zero; checks under traffic
//! that each rank's load lies between what σ held just before and just after the page showed
//! it (loads only grow here: requests start and generate, none finishes); cordons a rank
//! (Snapshot.SetCordon) and waits, under traffic, until the charts mark it, its row says
//! CORDONED and the decode panels show the group's tokens/s and a rank's TPOT estimate
//! (checked against the row's running requests and tokens/s), and saves a screenshot; stops the
//! traffic and checks that the page then shows exactly σ's loads, which are the workers' own;
//! checks that a group without workers says so; and saves screenshots under the target
//! directory.
//!
//! Without Chromium the test prints SKIPPED (on the real stderr, past the harness's capture)
//! and passes, unless `BR_REQUIRE_BROWSER=1` (CI) makes that a failure.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use br_client::assign::{AssignClient, AssignParams};
use br_e2e::{FakeWorker, Service};
use br_proto::v1;
use br_testkit::{eventually, eventually_some, within};

const NAME: &str = "the_live_page_shows_every_rank_and_its_load_in_chromium";
const GROUP: &str = "live";
/// A second served group that no worker joins: the page must say it has none.
const EMPTY: &str = "idle";
const RANKS: u32 = 4;
/// The rank the test cordons while the traffic runs.
const CORDONED: u32 = 1;
const START: Duration = Duration::from_secs(30);
/// How long the page may take to show what σ holds (a hang guard, not a timing assertion).
const PAGE: Duration = Duration::from_secs(90);
/// One Chromium run (start, load, script, dump): a hang guard.
const ONE_LOAD: Duration = Duration::from_secs(60);
/// The page's own time Chromium lets pass before it dumps or shoots: the script lists the
/// groups, fetches the group's history and draws it (timers run on virtual time; fetches to
/// the admin port are real and paused for).
const PAGE_TIME_MS: u32 = 3_000;
/// Assigns the traffic makes at most (the loop is bounded in count, and stopped by the test).
const MAX_REQUESTS: u32 = 400;

/// Says why the test did not run, on the real stderr: libtest captures `eprintln!` of passing
/// tests, and a skip nobody sees is a silent pass.
fn skipped(why: &str) {
    let _ = writeln!(std::io::stderr(), "\n{NAME}: SKIPPED: {why}");
}

/// `names` on PATH (or in /usr/bin, where Debian puts Chromium).
fn which(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs: Vec<PathBuf> = std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin")])
        .collect();
    names
        .iter()
        .flat_map(|n| dirs.iter().map(move |d| d.join(n)))
        .find(|p| p.is_file())
}

/// Headless Chromium with a profile of its own.
struct Browser {
    chromium: PathBuf,
    profile: tempfile::TempDir,
}

/// Chromium, or why not: `None` (skip) without it, a panic when `BR_REQUIRE_BROWSER=1` asks
/// for it.
fn browser() -> Option<Browser> {
    let required = std::env::var("BR_REQUIRE_BROWSER").is_ok_and(|v| v == "1");
    let Some(chromium) = which(&["chromium", "chromium-browser"]) else {
        let why = "no chromium on PATH; run scripts/install-browser.sh (Debian's chromium)";
        assert!(!required, "BR_REQUIRE_BROWSER=1 but {why}");
        skipped(why);
        return None;
    };
    Some(Browser {
        chromium,
        profile: tempfile::tempdir().unwrap(),
    })
}

impl Browser {
    /// Loads `url`, lets the page run for [`PAGE_TIME_MS`], then does `what` (`--dump-dom`,
    /// `--screenshot=PATH`); Chromium's stdout.
    async fn load(&self, url: &str, what: &str) -> String {
        // As root Chromium needs --no-sandbox; the background-networking flags keep it from
        // reaching for Google's hosts, which this machine's closed network refuses.
        let child = tokio::process::Command::new(&self.chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                "--window-size=1400,1400",
            ])
            .arg(format!("--user-data-dir={}", self.profile.path().display()))
            .arg(format!("--virtual-time-budget={PAGE_TIME_MS}"))
            .arg(what)
            .arg(url)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", self.chromium.display()));
        let out = within(
            ONE_LOAD,
            "Chromium loads the page",
            child.wait_with_output(),
        )
        .await
        .expect("Chromium's output");
        assert!(
            out.status.success(),
            "Chromium {what} {url}: {}",
            out.status
        );
        String::from_utf8(out.stdout).expect("UTF-8 from Chromium")
    }
}

/// What the page showed: per rank its `data-load` and the load cell's text, the σ version in
/// the header, the banner, and the group's name; the decode panels (per rank its running
/// requests, tokens/s and TPOT estimate, the group's tokens/s, the lines drawn in the two
/// charts), the ranks shown CORDONED and the labels of the charts' state-change markers.
#[derive(Debug, Default)]
struct Shown {
    loads: BTreeMap<u32, u64>,
    texts: BTreeMap<u32, String>,
    version: Option<u64>,
    banner: String,
    group: String,
    running: BTreeMap<u32, u32>,
    tokens_per_s: BTreeMap<u32, f64>,
    tpot_ms: BTreeMap<u32, f64>,
    cordoned: Vec<u32>,
    decode: Option<f64>,
    decode_lines: usize,
    tpot_lines: usize,
    markers: Vec<String>,
}

/// The value of attribute `name` in the start tag `tag` (`<tr class="rank" ...>`).
fn attr<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let key = format!(" {name}=\"");
    let at = tag.find(&key)? + key.len();
    tag[at..].split('"').next()
}

/// The element whose start tag contains `marker`: (its start tag, its text up to the next `<`).
fn element<'a>(dom: &'a str, marker: &str) -> Option<(&'a str, &'a str)> {
    let at = dom.find(marker)?;
    let open = dom[..at].rfind('<')?;
    let close = at + dom[at..].find('>')?;
    let text = dom[close + 1..].split('<').next().unwrap_or_default();
    Some((&dom[open..=close], text))
}

/// Reads the page's DOM as Chromium dumped it (the page builds every row with the same
/// attributes in the same order; see live.js).
fn parse(dom: &str) -> Shown {
    let mut s = Shown::default();
    for row in dom.split("<tr class=\"rank\"").skip(1) {
        let tag = &row[..row.find('>').expect("a row's start tag ends")];
        let id: u32 = attr(tag, "data-worker").unwrap().parse().unwrap();
        let load: u64 = attr(tag, "data-load").unwrap().parse().unwrap();
        let (_, text) = element(row, "class=\"num load\"").expect("the row's load cell");
        s.loads.insert(id, load);
        s.texts.insert(id, text.to_owned());
        let number = |name| attr(tag, name).and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = number("data-tokens-per-s") {
            s.tokens_per_s.insert(id, v);
        }
        if let Some(v) = number("data-tpot-ms") {
            s.tpot_ms.insert(id, v);
        }
        if attr(tag, "data-cordoned") == Some("true") {
            s.cordoned.push(id);
        }
        if let Some((_, n)) = element(row, "class=\"num running\"") {
            s.running
                .insert(id, n.parse().expect("the running cell is a count"));
        }
    }
    if let Some((tag, _)) = element(dom, "id=\"decode-now\"") {
        s.decode = attr(tag, "data-tokens-per-s").and_then(|v| v.parse().ok());
    }
    s.decode_lines = lines_in(dom, "chart-decode");
    s.tpot_lines = lines_in(dom, "chart-tpot");
    for label in dom.split("class=\"marker-label\">").skip(1) {
        let text = label.split('<').next().unwrap_or_default().to_owned();
        if !s.markers.contains(&text) {
            s.markers.push(text);
        }
    }
    if let Some((tag, _)) = element(dom, "id=\"sigma-version\"") {
        s.version = attr(tag, "data-version").and_then(|v| v.parse().ok());
    }
    if let Some((tag, text)) = element(dom, "id=\"banner\"")
        && !tag.contains(" hidden")
    {
        s.banner = text.to_owned();
    }
    if let Some((_, text)) = element(dom, "id=\"group-name\"") {
        s.group = text.to_owned();
    }
    s
}

/// The lines (`<path class="series">`) drawn in the chart `<svg id=ID>`.
fn lines_in(dom: &str, id: &str) -> usize {
    let Some(at) = dom.find(&format!("id=\"{id}\"")) else {
        return 0;
    };
    let svg = &dom[at..at + dom[at..].find("</svg>").unwrap_or(0)];
    svg.matches("class=\"series\"").count()
}

async fn shown(b: &Browser, url: &str) -> Shown {
    parse(&b.load(url, "--dump-dom").await)
}

async fn sigma(snapshot: &Service, group: &str) -> v1::ClusterSnapshot {
    let mut c = v1::snapshot_client::SnapshotClient::connect(snapshot.grpc_url())
        .await
        .unwrap();
    c.get(v1::GetRequest {
        group: group.into(),
    })
    .await
    .unwrap()
    .into_inner()
}

/// Per rank, the KV load σ counts (a reservation its prompt; active prompt + generated),
/// recomputed here from the requests.
fn loads_of(s: &v1::ClusterSnapshot) -> BTreeMap<u32, u64> {
    let mut m: BTreeMap<u32, u64> = s.workers.iter().map(|w| (w.worker_id, 0)).collect();
    for r in &s.requests {
        let generated = if r.state == v1::RequestPhase::Reserved as i32 {
            0
        } else {
            r.generated_tokens
        };
        *m.entry(r.worker_id).or_default() += u64::from(r.prompt_tokens) + u64::from(generated);
    }
    m
}

/// Gateway traffic until `stop`: Assign (JSQ) and start the request on the chosen worker, at
/// most [`MAX_REQUESTS`] of them, and now and then a decode step on every worker, which goes
/// on after the last Assign so the ranks decode while the page is read. No request finishes,
/// so every rank's load only grows. Returns the workers (their ground truth) once stopped.
async fn traffic(
    client: AssignClient,
    mut ws: Vec<FakeWorker>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<FakeWorker> {
    for i in 0u32.. {
        if *stop.borrow() {
            break;
        }
        if i < MAX_REQUESTS {
            let id = format!("page-{i}");
            let prompt = 100 + (i * 37) % 400;
            let a = client
                .assign_within(&AssignParams::new(GROUP, &id, prompt), START)
                .await
                .unwrap_or_else(|e| panic!("assign {id}: {e}"));
            ws[a.worker_id as usize].start(&id, prompt).await;
        }
        if i % 4 == 3 {
            for w in &mut ws {
                w.step(8).await;
            }
        }
        // Pacing, not synchronisation: a few requests and steps per sample, so the rounds
        // below see the loads grow while the page polls.
        tokio::select! {
            _ = stop.changed() => break,
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
    ws
}

async fn set_cordon(snapshot: &Service, worker_id: u32, cordoned: bool) {
    let mut c = v1::snapshot_client::SnapshotClient::connect(snapshot.grpc_url())
        .await
        .unwrap();
    let req = v1::SetCordonRequest {
        group: GROUP.into(),
        worker_id,
        cordoned,
    };
    within(START, "SetCordon", c.set_cordon(req))
        .await
        .expect("SetCordon");
}

fn screenshot_path() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("live-page")
        .join("live-page.png")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_page_shows_every_rank_and_its_load_in_chromium() {
    let Some(b) = browser() else {
        return;
    };
    let snapshot = Service::start("br-snapshot", &[]);
    snapshot.wait_for("/livez", START).await;
    let snap = snapshot.grpc_url();
    // The fake workers, unlike a shim, send no heartbeats: once the traffic stops they are
    // silent, and ingest's --stream-idle-timeout (10 s) would end their streams and σ would
    // move on (SUSPECT, fenced) while Chromium, slow on a loaded machine, is still loading the
    // page. The page must show a quiet σ, so nothing here may time the workers out.
    let ingest = Service::start(
        "br-ingest",
        &["--snapshot-addr", &snap, "--stream-idle-timeout", "0"],
    );
    let groups = format!("{GROUP},{EMPTY}");
    let decision = Service::start(
        "br-decision",
        &[
            "--snapshot-addr",
            &snap,
            "--policy",
            "jsq",
            "--groups",
            &groups,
            "--live-sample-interval",
            "250ms",
        ],
    );
    ingest.wait_for("/readyz", START).await;
    let mut ws = Vec::new();
    for id in 0..RANKS {
        ws.push(FakeWorker::connect(&ingest.grpc_url(), GROUP, id, 256).await);
    }
    decision.wait_for("/readyz", START).await;
    let url = decision.admin_url("/live");

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let client = AssignClient::connect_lazy(decision.grpc_url()).unwrap();
    let driver = tokio::spawn(traffic(client, ws, stopped));

    // Every rank appears with a load above zero.
    eventually(PAGE, "every rank's row shows a load above zero", || async {
        let s = shown(&b, &url).await;
        s.loads.len() == RANKS as usize && s.loads.values().all(|l| *l > 0)
    })
    .await;

    // Under traffic: what the page shows lies between σ just before and just after.
    for round in 0..3 {
        let before = sigma(&snapshot, GROUP).await;
        let page = eventually_some(PAGE, "the page shows σ at least as new as read", || async {
            let s = shown(&b, &url).await;
            s.version.is_some_and(|v| v >= before.version).then_some(s)
        })
        .await;
        let after = sigma(&snapshot, GROUP).await;
        let (lo, hi) = (loads_of(&before), loads_of(&after));
        assert_eq!(
            page.loads.keys().collect::<Vec<_>>(),
            hi.keys().collect::<Vec<_>>(),
            "round {round}: the page lists σ's ranks"
        );
        for (id, load) in &page.loads {
            assert!(
                lo[id] <= *load && *load <= hi[id],
                "round {round}: rank {id} shows {load}, σ moved from {} (v{}) to {} (v{})",
                lo[id],
                before.version,
                hi[id],
                after.version
            );
            // the visible number is the same load, as a person reads it (1,234)
            assert_eq!(
                page.texts[id].replace(',', ""),
                load.to_string(),
                "rank {id}'s cell"
            );
        }
        assert_eq!(page.group, format!("group {GROUP}"));
    }

    // An operator cordons a rank while the ranks decode: the charts mark the sample at which
    // σ showed it, its row says so, and the decode panels show the tokens/s σ counted and the
    // TPOT they imply.
    set_cordon(&snapshot, CORDONED, true).await;
    let marker = format!("rank {CORDONED} cordoned");
    let page = eventually_some(
        PAGE,
        "the cordon marked on the charts and the decode panels drawn",
        || async {
            let s = shown(&b, &url).await;
            let decoding = s.decode.is_some_and(|d| d > 0.0) && !s.tpot_ms.is_empty();
            (s.markers.iter().any(|m| m.starts_with(&marker))
                && s.cordoned == [CORDONED]
                && decoding)
                .then_some(s)
        },
    )
    .await;
    assert!(page.decode_lines >= 1, "the decode chart has its line");
    assert!(page.tpot_lines >= 1, "the TPOT chart has a rank's line");
    for (id, tpot) in &page.tpot_ms {
        // σ's running requests ÷ its tokens/s, in ms
        let (running, rate) = (page.running[id], page.tokens_per_s[id]);
        let want = 1e3 * f64::from(running) / rate;
        assert!(
            running > 0 && (tpot - want).abs() <= 1e-3 * want,
            "rank {id}: TPOT {tpot} ms, {running} running at {rate} tokens/s"
        );
    }
    let path = screenshot_path().with_file_name("live-page-decoding.png");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    b.load(&url, &format!("--screenshot={}", path.display()))
        .await;
    assert!(path.is_file(), "{}", path.display());

    // Quiet: the page shows exactly σ's loads, which are the workers' own.
    stop.send_replace(true);
    let ws = within(START, "the traffic stops", driver).await.unwrap();
    let truth: BTreeMap<u32, u64> = ws.iter().map(|w| (w.worker_id, w.load())).collect();
    let quiet = eventually_some(START, "σ holds the workers' loads", || async {
        let s = sigma(&snapshot, GROUP).await;
        (loads_of(&s) == truth).then_some(s)
    })
    .await;
    // At least the quiet version, not exactly it: σ can move on without any load changing (a
    // worker's report that it started a request whose reservation σ already counted at the
    // same prompt tokens may land just after `quiet` was read), and then the page never shows
    // `quiet.version` itself (CI hung here). Any change that does move a load fails the
    // assertion below with what the page showed.
    let page = eventually_some(PAGE, "the page shows the quiet σ", || async {
        let s = shown(&b, &url).await;
        s.version.is_some_and(|v| v >= quiet.version).then_some(s)
    })
    .await;
    assert_eq!(
        page.loads, truth,
        "the page's loads are σ's and the workers'"
    );
    assert!(
        page.banner.is_empty(),
        "no warning for a healthy group: {}",
        page.banner
    );

    // The screenshot a person would look at.
    let path = screenshot_path();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let _ = std::fs::remove_file(&path);
    b.load(&url, &format!("--screenshot={}", path.display()))
        .await;
    let png = std::fs::read(&path).expect("Chromium wrote the screenshot");
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    let _ = writeln!(
        std::io::stderr(),
        "\n{NAME}: screenshot ({} bytes): {}",
        png.len(),
        path.display()
    );

    // Several groups: the one no worker joined (`#group=` picks it) says so plainly.
    let idle = format!("{url}#group={EMPTY}");
    let empty = eventually_some(PAGE, "the empty group's banner", || async {
        let s = shown(&b, &idle).await;
        (s.group == format!("group {EMPTY}") && !s.banner.is_empty()).then_some(s)
    })
    .await;
    assert!(empty.banner.contains("has no workers"), "{}", empty.banner);
    assert!(empty.loads.is_empty(), "{empty:?}");
    let shot = path.with_file_name("live-page-empty-group.png");
    b.load(&idle, &format!("--screenshot={}", shot.display()))
        .await;
    assert!(shot.is_file(), "{}", shot.display());
}
