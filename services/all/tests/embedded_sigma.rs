//! The embedded decision holds the writer's σ: in br-all, decision's σ (what it places
//! requests on) and the snapshot writer's σ (what Get answers and what ingest's Apply and
//! decision's Reserve change) must be the same σ at the same (epoch, version), through
//! telemetry, reservations, a cordon, a fence and a new incarnation. Each step waits (bounded)
//! until the two agree and fails naming the step if they never do; nothing sleeps.
//!
//! In-process: br-all started as a library on port 0, telemetry played on its own port's
//! `Snapshot.Apply` (as ingest does), Assign and Get over its one gRPC port.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on purpose

mod common;

use br_proto::v1;
use br_proto::v1::decision_client::DecisionClient;
use br_proto::v1::snapshot_client::SnapshotClient;
use br_proto::v1::telemetry_change as tc;
use br_testkit::apply::{ApplyStream, change, hello, progress};
use br_testkit::{PATIENCE, eventually};
use tokio_util::sync::CancellationToken;

const GROUP: &str = "emb";

struct Plane {
    running: br_all::Running,
    stop: CancellationToken,
    url: String,
}

async fn start() -> Plane {
    let (running, stop) = common::start(
        GROUP,
        &[
            "--policy",
            "br0",
            // A reported disconnect fences its worker soon (the writer's clock does it).
            "--worker-grace",
            "200ms",
            "--reservation-ttl",
            "30s",
        ],
    )
    .await;
    let url = format!("http://{}", running.grpc_addr());
    Plane { running, stop, url }
}

impl Plane {
    /// The writer's σ, as `Snapshot.Get` answers it on br-all's port.
    async fn writer(&self) -> v1::ClusterSnapshot {
        SnapshotClient::connect(self.url.clone())
            .await
            .expect("br-all reachable")
            .get(v1::GetRequest {
                group: GROUP.into(),
            })
            .await
            .expect("Get")
            .into_inner()
    }

    /// Waits until decision's σ is the writer's σ: every worker (incarnation, liveness,
    /// cordon, load), every request (worker, phase, tokens), and the same (epoch, version).
    /// Returns that σ.
    async fn same_sigma(&self, step: &str) -> v1::ClusterSnapshot {
        let mut last = (None, None);
        let agreed = async {
            loop {
                let w = self.writer().await;
                let d = self.running.extra().sigma(GROUP).await;
                if d.as_ref() == Some(&w) {
                    return w;
                }
                last = (Some(w), d);
                tokio::task::yield_now().await;
            }
        };
        let agreed = tokio::time::timeout(PATIENCE, agreed).await;
        match agreed {
            Ok(s) => s,
            Err(_) => panic!(
                "{step}: decision's σ never became the writer's\nwriter:   {:?}\ndecision: {:?}",
                last.0, last.1
            ),
        }
    }

    async fn assign(&self, id: &str, prompt_tokens: u32) -> v1::AssignResponse {
        let mut d = DecisionClient::connect(self.url.clone()).await.unwrap();
        let mut r = tonic::Request::new(v1::AssignRequest {
            group: GROUP.into(),
            request_id: id.into(),
            prompt_tokens,
            prompt_hash: None,
            max_tokens: None,
            expected_output_tokens: None,
            request_class: None,
        });
        r.set_timeout(PATIENCE);
        d.assign(r)
            .await
            .unwrap_or_else(|s| panic!("Assign {id}: {s}"))
            .into_inner()
    }

    async fn stop(self) {
        self.stop.cancel();
        br_testkit::within(PATIENCE, "br-all stops", self.running.stop())
            .await
            .unwrap();
    }
}

fn disconnected(w: u32, inc: u64) -> v1::TelemetryChange {
    change(tc::Kind::WorkerDisconnected(tc::WorkerDisconnected {
        worker_id: w,
        incarnation: inc,
        disconnected_at_unix_ms: 0,
    }))
}

fn request<'a>(s: &'a v1::ClusterSnapshot, id: &str) -> Option<&'a v1::RequestState> {
    s.requests.iter().find(|r| r.request_id == id)
}

fn liveness(s: &v1::ClusterSnapshot, w: u32) -> Option<(u64, i32)> {
    s.workers
        .iter()
        .find(|x| x.worker_id == w)
        .map(|x| (x.incarnation, x.liveness))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_decision_places_on_the_writers_sigma() {
    let plane = start().await;
    let mut apply = ApplyStream::open(&plane.url).await;

    // Workers and their running requests: telemetry → the writer → decision.
    apply
        .send_ok(
            GROUP,
            vec![hello(0, 10, 2), hello(1, 20, 2), hello(2, 30, 2)],
        )
        .await;
    apply
        .send_ok(
            GROUP,
            vec![progress(0, 10, "a", 400, 3), progress(1, 20, "b", 900, 1)],
        )
        .await;
    let ack = apply
        .send_ok(GROUP, vec![progress(0, 10, "a", 400, 9)])
        .await;
    let s = plane.same_sigma("telemetry").await;
    assert_eq!(s.version, ack.version, "the ack names the version σ is at");
    assert_eq!(request(&s, "a").map(|r| r.generated_tokens), Some(9));
    eventually(PATIENCE, "decision ready", || async {
        plane.running.readiness().is_ready()
    })
    .await;

    // An Assign: decision's reservation goes into the writer's σ (in-process Reserve) and
    // decision sees it there, at the version that holds it; none is left only in decision.
    let x = plane.assign("x", 100).await;
    let s = plane.same_sigma("reservation").await;
    let r = request(&s, "x").expect("x reserved in σ");
    assert_eq!(
        (r.worker_id, r.incarnation, r.state),
        (
            x.worker_id,
            x.incarnation,
            v1::RequestPhase::Reserved as i32
        )
    );
    assert!(x.sigma_version <= s.version);
    eventually(PATIENCE, "no own reservation outside σ", || async {
        plane.running.extra().stats(GROUP).await.unwrap().local == 0
    })
    .await;
    // A retry is answered from the first answer, whatever σ did since.
    let again = plane.assign("x", 100).await;
    assert_eq!(again.worker_id, x.worker_id);

    // A cordon made on the writer (brctl's Snapshot.SetCordon) is one version both hold:
    // decision places nothing on the cordoned rank. Every rank but 2 is cordoned, so the next
    // Assign must go to rank 2.
    let mut snap = SnapshotClient::connect(plane.url.clone()).await.unwrap();
    for w in [0, 1] {
        snap.set_cordon(v1::SetCordonRequest {
            group: GROUP.into(),
            worker_id: w,
            cordoned: true,
        })
        .await
        .unwrap();
    }
    plane.same_sigma("cordons").await;
    let y = plane.assign("y", 100).await;
    assert_eq!(y.worker_id, 2, "only rank 2 takes new work");
    plane
        .same_sigma("a reservation on the one uncordoned rank")
        .await;

    // A fence: rank 2's stream is reported gone, it is SUSPECT, and after the grace the
    // writer's clock fences it, dropping its requests (y's reservation with them). Decision
    // holds the same σ after each step.
    apply.send_ok(GROUP, vec![disconnected(2, 30)]).await;
    let s = plane.writer().await;
    assert_ne!(
        liveness(&s, 2),
        Some((30, v1::Liveness::Live as i32)),
        "SUSPECT at once (or FENCED already, on a slow machine)"
    );
    eventually(PATIENCE, "rank 2 fenced by the writer", || async {
        liveness(&plane.writer().await, 2) == Some((30, v1::Liveness::Fenced as i32))
    })
    .await;
    let s = plane.same_sigma("fence").await;
    assert!(request(&s, "y").is_none(), "a fenced rank holds nothing");

    // A new incarnation starts clean; uncordoned ranks take work again.
    apply.send_ok(GROUP, vec![hello(2, 31, 2)]).await;
    for w in [0, 1] {
        snap.set_cordon(v1::SetCordonRequest {
            group: GROUP.into(),
            worker_id: w,
            cordoned: false,
        })
        .await
        .unwrap();
    }
    let s = plane.same_sigma("new incarnation").await;
    assert_eq!(liveness(&s, 2), Some((31, v1::Liveness::Live as i32)));
    let z = plane.assign("z", 100).await;
    let s = plane.same_sigma("after the fence").await;
    let r = request(&s, "z").expect("z reserved in σ");
    assert_eq!((r.worker_id, r.incarnation), (z.worker_id, z.incarnation));

    // Finished requests leave both.
    apply
        .send_ok(
            GROUP,
            vec![change(tc::Kind::RequestProgress(tc::RequestProgress {
                worker_id: 0,
                incarnation: 10,
                request_id: "a".into(),
                prompt_tokens: 400,
                generated_tokens: 12,
                finished: true,
                unkeyed: false,
            }))],
        )
        .await;
    let s = plane.same_sigma("a finished").await;
    assert!(request(&s, "a").is_none());

    plane.stop().await;
}

/// Many telemetry batches while Assigns are answered: the replica tracks every version the
/// writer commits and ends equal to it (a delta applied twice, skipped or reordered would
/// leave them apart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_decision_keeps_up_under_a_stream_of_batches() {
    let plane = start().await;
    let mut apply = ApplyStream::open(&plane.url).await;
    apply
        .send_ok(GROUP, vec![hello(0, 1, 64), hello(1, 2, 64)])
        .await;
    plane.same_sigma("hellos").await;
    eventually(PATIENCE, "decision ready", || async {
        plane.running.readiness().is_ready()
    })
    .await;
    let mut placed = Vec::new();
    for i in 0..40u32 {
        let a = plane.assign(&format!("r{i}"), 10 + i).await;
        placed.push((format!("r{i}"), a.worker_id, a.incarnation));
        // The worker reports it running, then more tokens of every running request.
        let mut changes: Vec<v1::TelemetryChange> = placed
            .iter()
            .map(|(id, w, inc)| progress(*w, *inc, id, 0, i + 1))
            .collect();
        if i % 7 == 6 {
            // and one finishes now and then
            let (id, w, inc) = placed.remove(0);
            changes.retain(
                |c| !matches!(&c.kind, Some(tc::Kind::RequestProgress(p)) if p.request_id == id),
            );
            changes.push(change(tc::Kind::RequestProgress(tc::RequestProgress {
                worker_id: w,
                incarnation: inc,
                request_id: id,
                prompt_tokens: 0,
                generated_tokens: i + 1,
                finished: true,
                unkeyed: false,
            })));
        }
        apply.send_ok(GROUP, changes).await;
    }
    let s = plane.same_sigma("after 40 Assigns and batches").await;
    assert_eq!(s.requests.len(), placed.len());
    for (id, w, _) in &placed {
        let r = request(&s, id).expect("running in σ");
        assert_eq!(r.worker_id, *w);
        assert_eq!(r.state, v1::RequestPhase::Active as i32);
    }
    let st = plane.running.extra().stats(GROUP).await.unwrap();
    assert_eq!(st.sigma, Some((s.epoch, s.version)));
    plane.stop().await;
    // The Apply stream stays open until here: its end would orphan the workers.
    drop(apply);
}
