//! Bounded waits that fail loudly. A check that itself hangs (a call to a server that never
//! answers) is cut off by the same deadline, so nothing here can wait forever.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// The first pause between two checks; it doubles up to [`MAX_PAUSE`] (quick when the
/// condition is about to hold, cheap when it takes a while).
const FIRST_PAUSE: Duration = Duration::from_millis(1);
const MAX_PAUSE: Duration = Duration::from_millis(50);

/// Polls `check` until it returns true; panics after `timeout` with "never happened: `what`".
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    eventually_or(timeout, what, check, String::new).await;
}

/// Polls `check` until it returns `Some`, and returns that; panics after `timeout` naming
/// `what`.
pub async fn eventually_some<T, F, Fut>(timeout: Duration, what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    eventually_some_or(timeout, what, check, String::new).await
}

/// As [`eventually`], and the panic also says `describe()`: what was seen instead (the last
/// values the check read, a peer's log), so a failure in CI can be read without a rerun.
pub async fn eventually_or<F, Fut>(
    timeout: Duration,
    what: &str,
    mut check: F,
    describe: impl FnOnce() -> String,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let check = || {
        let fut = check();
        async move { fut.await.then_some(()) }
    };
    eventually_some_or(timeout, what, check, describe).await;
}

async fn eventually_some_or<T, F, Fut>(
    timeout: Duration,
    what: &str,
    mut check: F,
    describe: impl FnOnce() -> String,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    let mut pause = FIRST_PAUSE;
    let how = loop {
        let started = Instant::now();
        match tokio::time::timeout_at(deadline, check()).await {
            Ok(Some(v)) => return v,
            Ok(None) => {}
            // A check that took most of the time hung; a slow one that the deadline merely
            // caught in flight (after others had finished) did not.
            Err(_) if started.elapsed() >= timeout / 2 => break " (the check itself hung)".into(),
            Err(_) => {
                break format!(" (the deadline cut off a check {:?} in)", started.elapsed());
            }
        }
        let now = Instant::now();
        if now >= deadline {
            break String::new();
        }
        tokio::time::sleep(pause.min(deadline - now)).await;
        pause = (pause * 2).min(MAX_PAUSE);
    };
    let seen = describe();
    let seen = if seen.is_empty() {
        seen
    } else {
        format!("; seen instead: {seen}")
    };
    panic!("never happened within {timeout:?}{how}: {what}{seen}")
}

/// Awaits `fut`; panics naming `what` if it has not finished after `timeout`.
pub async fn within<T>(timeout: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(timeout, fut).await {
        Ok(v) => v,
        Err(_) => panic!("did not happen within {timeout:?}: {what}"),
    }
}

/// A change counter a fake bumps whenever it records something; waiters sleep on it instead
/// of polling, and cannot miss a change that happens between their check and their wait.
#[derive(Debug, Clone)]
pub(crate) struct Signal(std::sync::Arc<tokio::sync::watch::Sender<u64>>);

impl Default for Signal {
    fn default() -> Self {
        Signal(std::sync::Arc::new(tokio::sync::watch::channel(0).0))
    }
}

impl Signal {
    pub(crate) fn bump(&self) {
        self.0.send_modify(|n| *n += 1);
    }

    /// Waits until `pred` holds, re-checking after every bump; panics after `timeout` with
    /// `what` and `describe()` (what was recorded instead).
    pub(crate) async fn wait_until(
        &self,
        timeout: Duration,
        what: &str,
        mut pred: impl FnMut() -> bool,
        describe: impl Fn() -> String,
    ) {
        let mut rx = self.0.subscribe();
        let deadline = Instant::now() + timeout;
        loop {
            rx.borrow_and_update();
            if pred() {
                return;
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                panic!(
                    "never happened within {timeout:?}: {what}; recorded instead: {}",
                    describe()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test]
    async fn eventually_returns_once_the_check_holds() {
        let n = Arc::new(AtomicU32::new(0));
        eventually(Duration::from_secs(5), "three checks", || {
            let n = n.clone();
            async move { n.fetch_add(1, Ordering::SeqCst) >= 2 }
        })
        .await;
        assert_eq!(n.load(Ordering::SeqCst), 3);
        let v = eventually_some(Duration::from_secs(5), "a value", || async { Some(7) }).await;
        assert_eq!(v, 7);
    }

    // Short real timeouts: these only check what a failure says.
    #[tokio::test]
    #[should_panic(expected = "never happened within 30ms: the sky falls")]
    async fn eventually_names_what_never_happened() {
        eventually(Duration::from_millis(30), "the sky falls", || async {
            false
        })
        .await;
    }

    #[tokio::test]
    #[should_panic(expected = "never happened within 30ms: the sky falls; seen instead: 41 clouds")]
    async fn eventually_or_says_what_was_seen_instead() {
        eventually_or(
            Duration::from_millis(30),
            "the sky falls",
            || async { false },
            || "41 clouds".to_owned(),
        )
        .await;
    }

    #[tokio::test]
    #[should_panic(expected = "the check itself hung")]
    async fn a_hanging_check_is_cut_off() {
        eventually(Duration::from_millis(30), "an answer", || {
            std::future::pending::<bool>()
        })
        .await;
    }

    #[tokio::test]
    #[should_panic(expected = "did not happen within 30ms: a reply")]
    async fn within_names_what_did_not_finish() {
        within(
            Duration::from_millis(30),
            "a reply",
            std::future::pending::<()>(),
        )
        .await;
    }

    #[tokio::test]
    async fn a_signal_wakes_its_waiter() {
        let s = Signal::default();
        let flag = Arc::new(AtomicU32::new(0));
        let (s2, f2) = (s.clone(), flag.clone());
        tokio::spawn(async move {
            f2.store(1, Ordering::SeqCst);
            s2.bump();
        });
        s.wait_until(
            Duration::from_secs(20),
            "the flag",
            || flag.load(Ordering::SeqCst) == 1,
            String::new,
        )
        .await;
    }
}
