//! Quotas per subject (docs/identity.md): a turn's are checked in the transaction that records
//! it (`store/quotas.rs`: exact, on one gateway or several sharing PostgreSQL); streams are
//! counted here and mirrored in the database for the other gateways. Administrators have none.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::Quotas;
use crate::store::{OverBudget, Store, StoreError, TurnBudget, now_ms};

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

/// The budget a subject's new turn is admitted against, under `quotas` (none when no turn
/// limit is set: the turn is neither checked nor counted).
pub fn turn_budget(quotas: &Quotas, subject: &str) -> Option<TurnBudget> {
    let budget = TurnBudget {
        subject: subject.to_owned(),
        concurrent_turns: quotas.concurrent_turns,
        turns_per_minute: quotas.turns_per_minute,
        tokens_per_day: quotas.tokens_per_day,
    };
    (budget.concurrent_turns.is_some() || budget.turns_per_minute.is_some() || budget.tokens_per_day.is_some())
        .then_some(budget)
}

/// The 429 a refused opening write is answered with.
impl From<OverBudget> for QuotaExceeded {
    fn from(over: OverBudget) -> QuotaExceeded {
        let OverBudget { limit, used, max, oldest_ms, window_ms } = over;
        let message = match limit {
            "concurrent_turns" => {
                format!("{used} of your turns are running, as many as your quota allows ({max}, concurrent_turns)")
            }
            "turns_per_minute" => {
                format!("you started {used} turns in the last minute, your quota (turns_per_minute)")
            }
            _ => format!("your turns used {used} tokens in the last 24 hours, your quota is {max} ({limit})"),
        };
        // A running turn may end any moment: look again in a few seconds. A window frees a
        // place when its oldest entry leaves it.
        let retry_after_secs = match oldest_ms {
            Some(oldest) => ((oldest + window_ms - now_ms()).max(0) as u64).div_ceil(1000),
            None if window_ms == 0 => 5,
            None => 1,
        };
        QuotaExceeded { limit, retry_after_secs: retry_after_secs.max(1), message }
    }
}

/// This gateway's open streams per subject, mirrored in the database for the others.
pub struct StreamQuota {
    store: Store,
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
    /// Counts streams when any `streams` quota can apply: the configured one, or a made key's
    /// (`auth`: keys can be made).
    pub fn new(store: Store, quotas: &Quotas, auth: bool) -> Arc<StreamQuota> {
        let quota = Arc::new(StreamQuota { store, gateway: uuid::Uuid::new_v4().to_string(), open: Mutex::default() });
        if (quotas.streams.is_some() || auth)
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(refresh(Arc::downgrade(&quota)));
        }
        quota
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, u64>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for one more stream of `subject` under `max` (its `streams` quota; none needed
    /// without one).
    pub async fn take(
        self: &Arc<Self>,
        subject: &Arc<str>,
        max: Option<u32>,
    ) -> Result<Option<StreamPlace>, QuotaError> {
        let Some(max) = max else { return Ok(None) };
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
