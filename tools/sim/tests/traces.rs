//! The loaders on excerpts of the three public traces, kept in `tests/data/` (provenance and
//! licences in its README). The expected figures were computed from the same files by an
//! independent script, not by this code. A missing file fails the test: nothing here depends on
//! files outside the repository, and nothing is skipped.

use std::path::PathBuf;

use br_sim::trace::{Filter, TraceFormat, load, summarize};

fn data(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name);
    assert!(
        p.is_file(),
        "{} is missing: the trace excerpts are part of the repository",
        p.display()
    );
    p
}

#[test]
fn azure_excerpt_loads_with_its_figures() {
    let t = load(&data("azure2023_conv.head300.csv"), &Filter::default()).expect("azure");
    assert_eq!(t.format, TraceFormat::AzureCsv);
    assert_eq!((t.stats.rows, t.requests.len()), (300, 300));
    let s = summarize(&t.requests);
    assert!((s.mean_prompt - 900.0).abs() < 1e-9, "{s:?}");
    assert!((s.mean_output - 256.233_333).abs() < 1e-3, "{s:?}");
    assert_eq!(s.max_output, 649);
    assert_eq!(
        t.requests[0].arrival_ms,
        Some(0.0),
        "times relative to the first row"
    );
    assert!((s.span_ms - 84_029.102).abs() < 1.0, "{s:?}");
}

#[test]
fn mooncake_excerpt_loads_with_its_figures() {
    let p = data("mooncake_conversation_trace.head300.jsonl");
    let t = load(&p, &Filter::default()).expect("mooncake");
    assert_eq!(t.format, TraceFormat::MooncakeJsonl);
    assert_eq!((t.stats.rows, t.requests.len()), (300, 300));
    let s = summarize(&t.requests);
    assert!((s.mean_prompt - 14_233.236_667).abs() < 1e-3, "{s:?}");
    assert_eq!(s.max_output, 2000);
    assert!((s.span_ms - 102_000.0).abs() < 1e-9, "{s:?}");
    // One request repeats an earlier request's full list of block hashes.
    assert!((s.repeat_share - 1.0 / 300.0).abs() < 1e-12, "{s:?}");
    let limited = load(
        &p,
        &Filter {
            min_output: None,
            limit: Some(100),
        },
    )
    .expect("mooncake");
    assert_eq!(limited.requests.len(), 100);
}

#[test]
fn sarathi_excerpt_loads_and_filters_long_outputs() {
    let p = data("sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.head300.csv");
    let t = load(&p, &Filter::default()).expect("sarathi");
    assert_eq!(t.format, TraceFormat::LengthCsv);
    assert_eq!((t.stats.rows, t.requests.len()), (300, 300));
    assert!(t.requests.iter().all(|r| r.arrival_ms.is_none()));
    let s = summarize(&t.requests);
    assert!((s.mean_prompt - 2_178.576_667).abs() < 1e-3, "{s:?}");
    let long = load(
        &p,
        &Filter {
            min_output: Some(1001),
            limit: None,
        },
    )
    .expect("sarathi");
    assert_eq!(long.stats.rows, 300);
    assert_eq!(long.requests.len(), 2, "outputs of 1001 tokens or more");
    assert!(long.requests.iter().all(|r| r.output_tokens >= 1001));
}
