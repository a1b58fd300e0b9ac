//! Quotas per subject (docs/identity.md): checked before a turn starts or a stream opens, against
//! counts kept in the database (`store/quotas.rs`), so every gateway of a cluster enforces the
//! same budget. Administrators have none. A check and the start it allows are not one
//! transaction: requests racing on several gateways may pass a limit by the few that raced.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::Quotas;
use crate::store::{Store, StoreError, now_ms};

const MINUTE_MS: i64 = 60_000;
const DAY_MS: i64 = 24 * 60 * 60 * 1000;

/// How often a gateway refreshes the stream counts it holds in the database.
const STREAM_REFRESH: Duration = Duration::from_secs(20);

/// A limit reached: answered 429 with `Retry-After` and `{"error", "limit"}`.
#[derive(Debug, Clone)]
pub struct QuotaExceeded {
    /// `concurrent_turns`, `turns_per_minute`, `streams` or `tokens_per_day`.
    pub limit: &'static str,
    pub retry_after_secs: u64,
    pub message: String,
}

#[derive(Debug)]
pub enum QuotaError {
    Exceeded(QuotaExceeded),
    Store(StoreError),
}

impl From<StoreError> for QuotaError {
    fn from(e: StoreError) -> QuotaError {
        QuotaError::Store(e)
    }
}

fn exceeded(limit: &'static str, retry_after_secs: u64, message: String) -> QuotaError {
    QuotaError::Exceeded(QuotaExceeded { limit, retry_after_secs: retry_after_secs.max(1), message })
}

/// Seconds until a window of `window_ms` that began at `oldest_ms` has moved past it.
fn until_free(oldest_ms: Option<i64>, window_ms: i64, now: i64) -> u64 {
    oldest_ms.map_or(1, |oldest| ((oldest + window_ms - now).max(0) as u64).div_ceil(1000))
}

/// Whether `subject` may start one more turn.
pub async fn check_turn_quotas(store: &Store, quotas: &Quotas, subject: &str) -> Result<(), QuotaError> {
    let now = now_ms();
    if let Some(max) = quotas.concurrent_turns {
        let running = store.running_turns(subject).await?;
        if running >= u64::from(max) {
            return Err(exceeded(
                "concurrent_turns",
                5,
                format!("{running} of your turns are running, as many as your quota allows ({max}, concurrent_turns)"),
            ));
        }
    }
    if let Some(max) = quotas.turns_per_minute {
        let used = store.turns_since(subject, now - MINUTE_MS).await?;
        if used.amount >= u64::from(max) {
            return Err(exceeded(
                "turns_per_minute",
                until_free(used.oldest_ms, MINUTE_MS, now),
                format!("you started {} turns in the last minute, your quota (turns_per_minute)", used.amount),
            ));
        }
    }
    if let Some(max) = quotas.tokens_per_day {
        let used = store.tokens_since(subject, now - DAY_MS).await?;
        if used.amount >= max {
            return Err(exceeded(
                "tokens_per_day",
                until_free(used.oldest_ms, DAY_MS, now),
                format!(
                    "your turns used {} tokens in the last 24 hours, your quota is {max} (tokens_per_day)",
                    used.amount
                ),
            ));
        }
    }
    Ok(())
}

/// This gateway's open streams per subject, mirrored in the database for the others.
pub struct StreamQuota {
    store: Store,
    max: Option<u32>,
    /// This gateway's name in `quota_streams` (new at every start: a restarted gateway's old
    /// row ages out).
    gateway: String,
    open: Mutex<HashMap<Arc<str>, u64>>,
}

/// One open stream of a subject; dropping it gives the place back.
pub struct StreamPlace {
    quota: Arc<StreamQuota>,
    subject: Arc<str>,
}

impl StreamQuota {
    pub fn new(store: Store, quotas: &Quotas) -> Arc<StreamQuota> {
        let quota = Arc::new(StreamQuota {
            store,
            max: quotas.streams,
            gateway: uuid::Uuid::new_v4().to_string(),
            open: Mutex::default(),
        });
        if quota.max.is_some()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(refresh(Arc::downgrade(&quota)));
        }
        quota
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, u64>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for one more stream of `subject` (none needed without a `streams` quota).
    pub async fn take(self: &Arc<Self>, subject: &Arc<str>) -> Result<Option<StreamPlace>, QuotaError> {
        let Some(max) = self.max else { return Ok(None) };
        let now = now_ms();
        let elsewhere = self.store.open_streams_elsewhere(&self.gateway, subject, now).await?;
        let open = {
            let mut counts = self.counts();
            let here = counts.entry(subject.clone()).or_default();
            if elsewhere + *here >= u64::from(max) {
                let open = elsewhere + *here;
                return Err(exceeded(
                    "streams",
                    5,
                    format!("you have {open} streams open, as many as your quota allows ({max}, streams)"),
                ));
            }
            *here += 1;
            *here
        };
        self.store.set_open_streams(&self.gateway, subject, open, now).await?;
        Ok(Some(StreamPlace { quota: self.clone(), subject: subject.clone() }))
    }
}

impl Drop for StreamPlace {
    fn drop(&mut self) {
        let open = {
            let mut counts = self.quota.counts();
            let Some(here) = counts.get_mut(&self.subject) else { return };
            *here = here.saturating_sub(1);
            let open = *here;
            if open == 0 {
                counts.remove(&self.subject);
            }
            open
        };
        let (quota, subject) = (self.quota.clone(), self.subject.clone());
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = quota.store.set_open_streams(&quota.gateway, &subject, open, now_ms()).await;
            });
        }
    }
}

/// Keeps this gateway's rows fresh while their streams are open.
async fn refresh(quota: std::sync::Weak<StreamQuota>) {
    let mut tick = tokio::time::interval(STREAM_REFRESH);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(quota) = quota.upgrade() else { return };
        let open: Vec<(Arc<str>, u64)> = quota.counts().iter().map(|(s, n)| (s.clone(), *n)).collect();
        for (subject, n) in open {
            let _ = quota.store.set_open_streams(&quota.gateway, &subject, n, now_ms()).await;
        }
        // Rows of gateways that stopped (each start is a new gateway) count for nothing: gone.
        let _ = quota.store.forget_stale_streams(now_ms()).await;
    }
}
