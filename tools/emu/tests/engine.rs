//! The emulated engine over HTTP: lockstep step times follow a·max L + b, slots bound what
//! runs and the rest waits in the rank's FIFO queue, the DP port honours
//! `X-data-parallel-rank`, and streams carry one chunk per token.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use br_emu::engine::{Colocated, EngineConfig, EngineServer, Stats, StepModel};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const A: f64 = 0.25;
const B: f64 = 7.0;

async fn engine(ranks: usize, slots: usize) -> EngineServer {
    engine_with(ranks, slots, model(A, 0.0, 0.0), None).await
}

/// The step model `a·max L + p·max P + c·max n + B`.
fn model(a: f64, c: f64, p: f64) -> StepModel {
    StepModel {
        a_ms_per_token: a,
        b_ms: B,
        c_ms_per_request: c,
        p_ms_per_prefill_token: p,
    }
}

/// An engine stepping as fast as it can (time scale 0).
async fn engine_with(
    ranks: usize,
    slots: usize,
    model: StepModel,
    colocated: Option<Colocated>,
) -> EngineServer {
    EngineServer::start(
        EngineConfig {
            ranks,
            slots,
            model,
            colocated,
            time_scale: 0.0,
            created: Some(1),
            ..EngineConfig::default()
        },
        CancellationToken::new(),
    )
    .await
    .unwrap()
}

async fn complete(url: String, prompt_tokens: u32, max_tokens: u32, stream: bool) -> String {
    let resp = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&json!({
            "model": "br-emu", "prompt": "x", "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens, "stream": stream, "ignore_eos": true,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.text().await.unwrap()
}

async fn stats(e: &EngineServer) -> Stats {
    reqwest::get(format!("http://{}/stats?loads=true", e.addrs.dp))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test]
async fn step_times_follow_a_max_plus_b() {
    let e = engine(2, 4).await;
    let r0 = format!("http://{}", e.addrs.ranks[0]);
    let r1 = format!("http://{}", e.addrs.ranks[1]);
    // One request alone first: the step log is exactly its growth.
    complete(r0.clone(), 100, 3, true).await;
    let s = stats(&e).await;
    assert_eq!(s.steps, 3);
    assert_eq!(s.loads, vec![vec![100, 0], vec![101, 0], vec![102, 0]]);
    for k in 0..s.steps {
        assert_eq!(s.model_ms[k], A * s.max_load[k] as f64 + B);
        assert_eq!(s.max_load[k] - s.min_load[k], s.max_load[k]);
    }
    // Concurrent requests on both ranks: every step waits for the most loaded rank.
    reqwest::Client::new()
        .post(format!("{r0}/stats/reset"))
        .send()
        .await
        .unwrap();
    let (a, b) = tokio::join!(
        complete(r0.clone(), 50, 20, true),
        complete(r1.clone(), 500, 20, false)
    );
    assert!(a.ends_with("data: [DONE]\n\n"));
    let full: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(full["usage"]["completion_tokens"], 20);
    assert_eq!(full["usage"]["prompt_tokens"], 500);
    let s = stats(&e).await;
    assert!(s.steps >= 20);
    for k in 0..s.steps {
        assert_eq!(s.model_ms[k], A * s.max_load[k] as f64 + B);
        assert_eq!(s.max_load[k], *s.loads[k].iter().max().unwrap());
        assert_eq!(s.sum_load[k], s.loads[k].iter().sum::<u64>());
    }
    assert!(
        s.max_load.contains(&519),
        "rank 1 reaches 500 + 19: {:?}",
        s.max_load
    );
    e.shutdown().await;
}

#[tokio::test]
async fn slots_bound_running_requests_and_the_rest_queue_in_order() {
    let e = engine(1, 1).await;
    let r0 = format!("http://{}", e.addrs.ranks[0]);
    let (a, b) = tokio::join!(complete(r0.clone(), 10, 4, true), async {
        // Submitted while the first holds the only slot.
        tokio::task::yield_now().await;
        complete(r0.clone(), 1000, 2, true).await
    });
    assert_eq!(a.matches("\"text\"").count(), 4);
    assert_eq!(b.matches("\"text\"").count(), 2);
    let s = stats(&e).await;
    // One at a time: never both loads in the same step.
    assert_eq!(s.steps, 6);
    for l in &s.loads {
        let v = l[0];
        assert!((10..14).contains(&v) || (1000..1002).contains(&v), "{v}");
    }
    e.shutdown().await;
}

#[tokio::test]
async fn dp_port_honours_the_rank_header_and_streams_one_chunk_per_token() {
    let e = engine(3, 2).await;
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", e.addrs.dp))
        .header("X-data-parallel-rank", "2")
        .header("X-Request-Id", "r-1")
        .json(&json!({
            "model": "br-emu",
            "messages": [{"role": "user", "content": "abcdabcd"}],
            "max_tokens": 5, "stream": true,
            "stream_options": {"include_usage": true, "continuous_usage_stats": true},
        }))
        .send()
        .await
        .unwrap();
    let text = resp.text().await.unwrap();
    let chunks: Vec<Value> = text
        .split("\n\n")
        .filter_map(|ev| ev.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    // role chunk + 5 tokens + usage chunk
    assert_eq!(chunks.len(), 7);
    assert!(chunks.iter().all(|c| c["id"] == "chatcmpl-r-1"));
    assert_eq!(chunks[5]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 5);
    assert_eq!(chunks[6]["choices"], json!([]));
    let s = stats(&e).await;
    assert!(s.loads.iter().all(|l| l[0] == 0 && l[1] == 0 && l[2] > 0));
    let bad = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", e.addrs.dp))
        .header("X-data-parallel-rank", "7")
        .json(&json!({"prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    let models: Value = reqwest::get(format!("http://{}/v1/models", e.addrs.ranks[0]))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "br-emu");
    e.shutdown().await;
}

/// The step log is a `br-sim calibrate` sample set: with a request term (`--step-c`) the
/// engine's steps, read back from `/stats` as `max_kv_tokens,max_running,step_ms`, fit back to
/// the a, c and b it ran with.
#[tokio::test]
async fn step_log_with_a_request_term_calibrates_back_to_its_model() {
    const C: f64 = 0.3;
    let e = engine_with(2, 16, model(2e-3, C, 0.0), None).await;
    let r0 = format!("http://{}", e.addrs.ranks[0]);
    let r1 = format!("http://{}", e.addrs.ranks[1]);
    // batches that move tokens and requests apart: many short prompts on rank 0, one long on
    // rank 1, and the other way round
    for (k, prompt, long) in [(1, 50, 4000), (8, 30, 200), (3, 900, 100), (12, 10, 2500)] {
        let mut batch = tokio::task::JoinSet::new();
        for _ in 0..k {
            batch.spawn(complete(r0.clone(), prompt, 4, false));
        }
        batch.spawn(complete(r1.clone(), long, 4, false));
        while let Some(done) = batch.join_next().await {
            done.unwrap();
        }
    }
    let s = stats(&e).await;
    assert_eq!(s.c_ms_per_request, C);
    assert_eq!(s.max_running.len(), s.steps);
    let mut csv = String::from("max_kv_tokens,max_running,step_ms\n");
    for k in 0..s.steps {
        // (JSON parsing is exact to an ulp, not bit for bit)
        let want = 2e-3 * s.max_load[k] as f64 + B + C * f64::from(s.max_running[k]);
        assert!((s.model_ms[k] - want).abs() < 1e-9, "step {k}: {s:?}");
        csv.push_str(&format!(
            "{},{},{}\n",
            s.max_load[k], s.max_running[k], s.model_ms[k]
        ));
    }
    let fit = br_sim::calibrate::calibrate_text(std::path::Path::new("stats"), &csv, true)
        .expect("the step log identifies a, c and b");
    assert!((fit.a - 2e-3).abs() < 1e-9, "{fit:?}");
    assert!((fit.c - C).abs() < 1e-6, "{fit:?}");
    assert!((fit.b - B).abs() < 1e-6, "{fit:?}");
    e.shutdown().await;
}

/// With colocated prefill a 2,500-token prompt runs in three 1,000-token chunks before its first
/// token, the other rank's steps wait for them, and the engine's TTFT is those steps' time.
#[tokio::test]
async fn colocated_prefill_runs_in_chunks_and_the_engine_reports_ttft() {
    const P: f64 = 0.01;
    let e = engine_with(2, 4, model(A, 0.0, P), Some(Colocated { chunk: 1_000 })).await;
    let r0 = format!("http://{}", e.addrs.ranks[0]);
    complete(r0, 2_500, 2, false).await;
    let s = stats(&e).await;
    assert_eq!(s.prefill_chunk, Some(1_000));
    assert_eq!(s.p_ms_per_prefill_token, P);
    assert_eq!(s.max_prefill, vec![1_000, 1_000, 500, 0], "{s:?}");
    assert_eq!(s.max_load, vec![0, 1_000, 2_000, 2_501]);
    for k in 0..s.steps {
        let want = A * s.max_load[k] as f64 + P * s.max_prefill[k] as f64 + B;
        assert!((s.model_ms[k] - want).abs() < 1e-9, "step {k}: {s:?}");
    }
    let ttft: f64 = s.model_ms[..3].iter().sum();
    assert_eq!(s.ttft_model_ms.len(), 1);
    assert!((s.ttft_model_ms[0] - ttft).abs() < 1e-9, "{s:?}");
    // `since` lists the first tokens of the steps it lists
    let later: Stats = reqwest::get(format!("http://{}/stats?since=3", e.addrs.dp))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        later.ttft_model_ms.is_empty() && later.steps == 1,
        "{later:?}"
    );
}

/// A colocated engine's step log (`max_load`, `max_prefill`, `max_running`, `model_ms`) is a
/// `br-sim calibrate` sample set with a prefill column, and fits back to the a, p, c and b the
/// engine ran with.
#[tokio::test]
async fn a_colocated_step_log_calibrates_back_to_its_model() {
    const P: f64 = 3e-3;
    const C: f64 = 0.2;
    let e = engine_with(2, 16, model(2e-3, C, P), Some(Colocated { chunk: 700 })).await;
    let r0 = format!("http://{}", e.addrs.ranks[0]);
    let r1 = format!("http://{}", e.addrs.ranks[1]);
    // prompts of several sizes and batches of several widths, so tokens, prefill and requests
    // move apart
    for (k, prompt, long) in [(1, 50, 4000), (8, 30, 200), (3, 900, 100), (12, 10, 2500)] {
        let mut batch = tokio::task::JoinSet::new();
        for _ in 0..k {
            batch.spawn(complete(r0.clone(), prompt, 6, false));
        }
        batch.spawn(complete(r1.clone(), long, 3, false));
        while let Some(done) = batch.join_next().await {
            done.unwrap();
        }
    }
    let s = stats(&e).await;
    assert_eq!(s.max_prefill.len(), s.steps);
    assert!(s.max_prefill.contains(&700), "a full chunk ran: {s:?}");
    let mut csv = String::from("max_kv_tokens,max_prefill_tokens,max_running,step_ms\n");
    for k in 0..s.steps {
        csv.push_str(&format!(
            "{},{},{},{}\n",
            s.max_load[k], s.max_prefill[k], s.max_running[k], s.model_ms[k]
        ));
    }
    let fit = br_sim::calibrate::calibrate_text(std::path::Path::new("stats"), &csv, true)
        .expect("the step log identifies a, p, c and b");
    assert!((fit.a - 2e-3).abs() < 1e-9, "{fit:?}");
    assert!((fit.p - P).abs() < 1e-9, "{fit:?}");
    assert!((fit.c - C).abs() < 1e-6, "{fit:?}");
    assert!((fit.b - B).abs() < 1e-6, "{fit:?}");
    e.shutdown().await;
}
