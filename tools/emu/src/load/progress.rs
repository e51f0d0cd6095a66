//! The run's progress on standard error: a bar on a terminal and, either way, a line every
//! [`Progress::EVERY`], so a long run in a log says it is alive.
//!
//! Separate because it is presentation only: nothing in the run depends on it.

use super::*;

/// How far a run is, on standard error: a progress bar on a terminal (indicatif hides it
/// otherwise) and, either way, one line every [`Progress::EVERY`] (done, failed, in flight,
/// tokens per second), so a long run in a log or CI says it is alive.
#[derive(Clone)]
pub(super) struct Progress {
    bar: indicatif::ProgressBar,
    counts: Arc<ProgressCounts>,
    ticker: Arc<tokio::task::JoinHandle<()>>,
}

#[derive(Default)]
pub(super) struct ProgressCounts {
    pub(super) done: std::sync::atomic::AtomicU64,
    pub(super) failed: std::sync::atomic::AtomicU64,
    pub(super) tokens: std::sync::atomic::AtomicU64,
}

impl Progress {
    const EVERY: Duration = Duration::from_secs(5);

    pub(super) fn start(total: usize) -> Progress {
        let bar = indicatif::ProgressBar::new(total as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        let counts = Arc::new(ProgressCounts::default());
        let ticker = {
            let (bar, counts) = (bar.clone(), counts.clone());
            let started = Instant::now();
            tokio::spawn(async move {
                let mut every = tokio::time::interval(Self::EVERY);
                every.tick().await;
                loop {
                    every.tick().await;
                    let line = counts.line(total, started.elapsed());
                    if bar.is_hidden() {
                        eprintln!("br-emu load: {line}");
                    } else {
                        bar.println(line);
                    }
                }
            })
        };
        Progress {
            bar,
            counts,
            ticker: Arc::new(ticker),
        }
    }

    pub(super) fn record(&self, r: &RequestResult) {
        use std::sync::atomic::Ordering::Relaxed;
        self.counts.done.fetch_add(1, Relaxed);
        if r.error.is_some() {
            self.counts.failed.fetch_add(1, Relaxed);
        }
        self.counts
            .tokens
            .fetch_add(u64::from(r.generated), Relaxed);
        self.bar.inc(1);
        let failed = self.counts.failed.load(Relaxed);
        if failed > 0 {
            self.bar.set_message(format!("({failed} failed)"));
        }
    }

    pub(super) fn finish(&self) {
        self.ticker.abort();
        self.bar.finish_and_clear();
    }
}

impl ProgressCounts {
    pub(super) fn line(&self, total: usize, elapsed: Duration) -> String {
        use std::sync::atomic::Ordering::Relaxed;
        let done = self.done.load(Relaxed);
        let tokens = self.tokens.load(Relaxed);
        format!(
            "{:.0}s: {done}/{total} done, {} failed, {} to go, {:.0} tokens/s",
            elapsed.as_secs_f64(),
            self.failed.load(Relaxed),
            (total as u64).saturating_sub(done),
            tokens as f64 / elapsed.as_secs_f64().max(1e-9)
        )
    }
}
