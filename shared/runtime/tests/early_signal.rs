//! A SIGTERM that arrives right after `shutdown_on_signal` returns, before the task it spawned
//! has first run, drains the process: the handlers are installed before it returns. They used
//! to be installed by that task, so such a signal met the default action and killed the process
//! undrained (seen: a br-shim stopped right after its start-up line exited by signal, not 0).
//! A test binary of its own: the signal goes to the whole process.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on purpose

use std::time::Duration;

#[test]
fn a_sigterm_before_the_waiting_task_runs_cancels_the_token() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let token = br_runtime::serve::shutdown_on_signal();
        // Nothing has yielded: on this current-thread runtime the spawned task has not run.
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &std::process::id().to_string()])
            .status()
            .expect("running kill");
        assert!(sent.success(), "kill -TERM: {sent:?}");
        // A hang guard, not a timing assertion.
        tokio::time::timeout(Duration::from_secs(30), token.cancelled())
            .await
            .expect("the SIGTERM cancels the token");
    });
}
