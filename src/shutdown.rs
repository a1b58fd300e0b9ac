//! Shutting down, in the order a client needs it. SIGINT or SIGTERM ([`signal`]) starts it:
//!
//! 1. **Closing**: `/ready` and new turns answer 503; running turns are aborted, end with
//!    `done{reason:"aborted"}` and seal (`Turns::abort_all`).
//! 2. **Runtimes stop**: agent processes get their credential's `grace_secs` to exit once their
//!    input is closed (`Turns::shutdown_runtimes`).
//! 3. **Grace**: reads go on for `--shutdown-grace-ms`, so that the clients of the turns that
//!    just sealed read their history and metrics.
//! 4. **Drained**: live streams write what they have and end, connections close after their
//!    response, the listeners stop (the `drained` token every stream and connection holds).
//!
//! All of it within `--shutdown-timeout-secs`; then the store closes.

use std::future::Future;
use std::time::Duration;

use crate::http::AppState;

/// Listens for SIGINT and SIGTERM from now on; the future resolves on the first of them.
#[cfg(unix)]
pub fn signal() -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
    })
}

/// Resolves on Ctrl-C.
#[cfg(not(unix))]
pub fn signal() -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}

/// Runs the steps above once the signal came; `listeners` resolves when every listener has
/// stopped (which it does once drained).
pub async fn run(state: &AppState, listeners: impl Future<Output = ()>) {
    let turns = &state.turns;
    let config = &state.config;
    tracing::info!(running = turns.running(), "shutting down: aborting running turns");
    turns.abort_all();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(config.shutdown_timeout_secs.max(1));
    while turns.running() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    turns.shutdown_runtimes().await;
    let grace = Duration::from_millis(config.shutdown_grace_ms);
    tokio::time::sleep_until((tokio::time::Instant::now() + grace).min(deadline)).await;
    state.drained.cancel();
    if tokio::time::timeout_at(deadline, listeners).await.is_err() {
        tracing::warn!("connections still open at the shutdown deadline; closing anyway");
    }
    state.store.close().await;
    tracing::info!("stopped");
}
