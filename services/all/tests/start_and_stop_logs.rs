//! What br-all logs when it starts and stops: one start-up line, at INFO, that says what an
//! operator checks first (ports, groups, TLS, version), and a clean stop (SIGTERM's path: the
//! shutdown token) that logs nothing at WARN or above. Before, the embedded decision announced
//! itself with a `--snapshot-addr` it does not use, and a clean stop could log "σ feed lost"
//! (decision's group task) or "snapshot service ended the Apply stream" (ingest's forwarder).
//!
//! The events are captured by a tracing layer installed for this test binary (one test, so
//! the global subscriber is its own).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on purpose

mod common;

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use br_testkit::{PATIENCE, eventually};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt as _};

const GROUP: &str = "logs";

/// One captured event: its level and its fields as `name=value` (the message first).
#[derive(Debug, Clone)]
struct Line {
    level: Level,
    text: String,
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Line>>>);

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={:?}", field.name(), value);
    }
}

impl<S: Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut f = Fields(String::new());
        event.record(&mut f);
        self.0.lock().unwrap().push(Line {
            level: *event.metadata().level(),
            text: f.0,
        });
    }
}

impl Capture {
    fn lines(&self) -> Vec<Line> {
        self.0.lock().unwrap().clone()
    }
}

impl Capture {
    fn take(&self) -> Vec<Line> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// Start-and-stop cycles: the WARNs a clean stop logged came from races between the
/// components' shutdowns (ingest's Apply stream ending before its shutdown branch ran: 2 of 20
/// runs of one cycle), so one cycle could pass by luck.
const CYCLES: usize = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_start_up_line_at_info_and_a_clean_stop_without_warnings() {
    let capture = Capture::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(capture.clone()))
        .unwrap();
    for cycle in 0..CYCLES {
        start_and_stop(&capture, cycle).await;
    }
}

async fn start_and_stop(capture: &Capture, cycle: usize) {
    let (running, stop) = common::start(GROUP, &[]).await;
    let grpc = running.grpc_addr().to_string();
    let admin = running.admin_addr().to_string();
    // The group task holds σ and ingest's Apply stream is up: their ends on shutdown are
    // what warned.
    eventually(PATIENCE, "decision's group task installs σ", || async {
        capture
            .lines()
            .iter()
            .any(|l| l.text.contains("σ snapshot installed"))
    })
    .await;

    let started: Vec<Line> = capture
        .lines()
        .into_iter()
        .filter(|l| l.text.contains("br-all started") || l.text.contains("br-decision started"))
        .collect();
    assert_eq!(started.len(), 1, "one start-up line: {started:#?}");
    assert!(started[0].text.contains("br-all started"), "{started:#?}");
    assert_eq!(started[0].level, Level::INFO, "{started:#?}");
    let line = &started[0].text;
    for field in [
        format!("grpc={grpc}"),
        format!("admin={admin}"),
        "tls=false".to_string(),
        format!("version=\"{}\"", env!("CARGO_PKG_VERSION")),
    ] {
        assert!(line.contains(&field), "{field} in {line}");
    }
    assert!(line.contains("groups=") && line.contains(GROUP), "{line}");
    assert!(
        !line.contains("snapshot="),
        "no unused --snapshot-addr: {line}"
    );

    // A clean stop ends without an error and logs nothing at WARN or above.
    stop.cancel();
    running.wait().await.unwrap();
    let lines = capture.take();
    let loud: Vec<&Line> = lines.iter().filter(|l| l.level <= Level::WARN).collect();
    assert!(
        loud.is_empty(),
        "cycle {cycle}: a clean start and stop logged {loud:#?}\nevery line: {lines:#?}"
    );
}
