//! `GET /metrics/errors`: the last week's failed turns with their errors, newest first.
//!
//! `GET /metrics/series`: each model's sealed turns over a day, an ISO week or a month (UTC), by
//! hour or by day: turns, failures, stops, error rate, time to first token (p50, p95) and output
//! tokens per second. The database counts and sums (src/store/series.rs); the quantiles are
//! read from counts of fixed classes, interpolated within a class as Prometheus's
//! `histogram_quantile` reads `dispatch_model_ttft_seconds`, so both agree.

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::State;
use serde::Serialize;

use super::AppState;
use super::error::ApiError;
#[cfg(feature = "openapi")]
use super::error::ErrorBody;
use super::extract::{Caller, QueryParams};
use super::throughput::{Period, period};
use crate::store::{FailedTurn, SlotRow, TTFT_BOUNDS_MS, now_ms};

const HOUR_MS: i64 = 3_600_000;
const DAY_MS: i64 = 24 * HOUR_MS;

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Series {
    /// `day`, `week` or `month`.
    pub period: String,
    /// The day (`YYYY-MM-DD`) or month (`YYYY-MM`) asked for.
    pub date: String,
    /// Start of the period, epoch ms (inclusive).
    pub start: i64,
    /// End of the period, epoch ms (exclusive).
    pub end: i64,
    /// `hour` or `day`.
    pub bucket: String,
    pub bucket_ms: i64,
    /// Each model that sealed a turn in the period, by name.
    pub models: Vec<ModelSeries>,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ModelSeries {
    pub model: String,
    /// The buckets with turns, oldest first.
    pub points: Vec<SeriesPoint>,
}

#[derive(Debug, Default, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SeriesPoint {
    /// The bucket's start, epoch ms.
    pub at: i64,
    pub turns: i64,
    /// Turns that ended `error`.
    pub failed: i64,
    /// Turns that were stopped (`aborted`).
    pub aborted: i64,
    /// `failed / turns`.
    pub error_rate: f64,
    /// Time to first token of the turns' first steps, p50 and p95, in ms; absent when no turn
    /// had a first token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_p50_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_p95_ms: Option<f64>,
    /// Output tokens over generation seconds (steps that reported output only); absent when
    /// none did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_tokens_per_second: Option<f64>,
    #[serde(skip)]
    classes: [i64; TTFT_BOUNDS_MS.len() + 1],
    #[serde(skip)]
    output_tokens: i64,
    #[serde(skip)]
    gen_ms: i64,
}

/// Each model's turns over a period, by hour or day.
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/metrics/series",
    tag = "operations",
    params(
        ("period" = Option<String>, Query, description = "`day` (default), `week` (ISO, Monday first) or `month`"),
        ("date" = Option<String>, Query, description = "`YYYY-MM-DD`, or `YYYY-MM` for a month; default today (UTC). A user's answer counts their own turns"),
        ("bucket" = Option<String>, Query, description = "`hour` (the default for a day or a week; not for a month) or `day` (the default for a month)"),
    ),
    responses((status = 200, body = Series), (status = 400, body = ErrorBody))
))]
pub async fn series(
    State(state): State<AppState>,
    Caller(caller): Caller,
    query: QueryParams,
) -> Result<Json<Series>, ApiError> {
    let Period { period, date, start, end } = period(&query)?;
    let (bucket, bucket_ms) = match (query.get("bucket"), period) {
        (None, "month") | (Some("day"), _) => ("day", DAY_MS),
        // 744 hours of a month by each model would be an answer of its own.
        (Some("hour"), "month") => {
            return Err(ApiError::bad("a month goes by day: `bucket=hour` is for a day or a week"));
        }
        (None | Some("hour"), _) => ("hour", HOUR_MS),
        (Some(other), _) => return Err(ApiError::bad(format!("`bucket` takes hour or day, got {other:?}"))),
    };
    // A user counts their own turns; an administrator everyone's.
    let rows = state.store.series(start, end, bucket_ms, caller.viewer().map(|v| &**v)).await?;
    let models = gather(rows, start, bucket_ms);
    Ok(Json(Series { period: period.to_owned(), date, start, end, bucket: bucket.to_owned(), bucket_ms, models }))
}

/// How far back `/metrics/errors` looks: a week.
const ERRORS_WINDOW_MS: i64 = 7 * DAY_MS;
const DEFAULT_ERRORS: u64 = 20;
const MOST_ERRORS: u64 = 100;

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RecentErrors {
    /// Newest first.
    pub errors: Vec<RecentError>,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RecentError {
    pub conversation_id: String,
    pub turn_id: String,
    pub model: String,
    /// When the turn sealed, epoch ms.
    pub at: i64,
    /// The turn's error, as its log keeps it (empty when the error could not be written).
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
}

/// The turns of the last seven days that ended with an error, newest first.
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/metrics/errors",
    tag = "operations",
    params(("limit" = Option<u64>, Query, description = "At most this many (default 20, max 100). A user's answer has their own turns")),
    responses((status = 200, body = RecentErrors), (status = 400, body = ErrorBody))
))]
pub async fn errors(
    State(state): State<AppState>,
    Caller(caller): Caller,
    query: QueryParams,
) -> Result<Json<RecentErrors>, ApiError> {
    let limit = query.integer("limit", 1, MOST_ERRORS)?.unwrap_or(DEFAULT_ERRORS);
    let since = now_ms() - ERRORS_WINDOW_MS;
    let failed = state.store.failed_turns(since, limit as u32, caller.viewer().map(|v| &**v)).await?;
    Ok(Json(RecentErrors { errors: failed.into_iter().map(recent_error).collect() }))
}

/// A failed turn as listed. An error chunk longer than the store reads is cut, and no longer
/// JSON: its message says where the whole one is.
fn recent_error(turn: FailedTurn) -> RecentError {
    let chunk: Option<serde_json::Value> =
        turn.error_chunk.as_deref().map(|c| serde_json::from_str(c).unwrap_or_default());
    let message = match &chunk {
        Some(serde_json::Value::Null) => {
            "(an error too long to list; the conversation's history has it whole)".to_owned()
        }
        Some(chunk) => chunk["message"].as_str().unwrap_or_default().to_owned(),
        None => String::new(),
    };
    let chunk = chunk.unwrap_or_default();
    RecentError {
        message,
        code: chunk["code"].as_str().map(str::to_owned),
        conversation_id: turn.conversation_id,
        turn_id: turn.turn_id,
        model: turn.model,
        at: turn.sealed_at,
    }
}

/// The rows (by model, slot, class) as each model's points.
fn gather(rows: Vec<SlotRow>, start: i64, bucket_ms: i64) -> Vec<ModelSeries> {
    let mut models: BTreeMap<String, BTreeMap<i64, SeriesPoint>> = BTreeMap::new();
    for row in rows {
        let point = models.entry(row.model).or_default().entry(row.slot).or_default();
        point.at = start + row.slot * bucket_ms;
        point.turns += row.turns;
        point.failed += row.failed;
        point.aborted += row.aborted;
        point.output_tokens += row.output_tokens;
        point.gen_ms += row.gen_ms;
        if let Some(class) = row.class.filter(|c| *c <= TTFT_BOUNDS_MS.len()) {
            point.classes[class] += row.turns;
        }
    }
    models
        .into_iter()
        .map(|(model, points)| ModelSeries {
            model,
            points: points
                .into_values()
                .map(|mut p| {
                    p.error_rate = p.failed as f64 / p.turns.max(1) as f64;
                    p.ttft_p50_ms = quantile(0.5, &p.classes);
                    p.ttft_p95_ms = quantile(0.95, &p.classes);
                    p.output_tokens_per_second =
                        (p.gen_ms > 0).then(|| p.output_tokens as f64 * 1000.0 / p.gen_ms as f64);
                    p
                })
                .collect(),
        })
        .collect()
}

/// The `q` quantile of counts by class (`TTFT_BOUNDS_MS`, then one slower), interpolated
/// within its class; in the slower class, the last bound.
fn quantile(q: f64, classes: &[i64; TTFT_BOUNDS_MS.len() + 1]) -> Option<f64> {
    let total: i64 = classes.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let (mut lower, mut below) = (0.0, 0i64);
    for (i, count) in classes.iter().enumerate() {
        let cumulative = below + count;
        if cumulative as f64 >= rank && *count > 0 {
            let Some(bound) = TTFT_BOUNDS_MS.get(i).map(|b| *b as f64) else { return Some(lower) };
            return Some(lower + (bound - lower) * (rank - below as f64) / *count as f64);
        }
        below = cumulative;
        if let Some(bound) = TTFT_BOUNDS_MS.get(i) {
            lower = *bound as f64;
        }
    }
    Some(lower)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_cut_by_the_store_is_listed_as_too_long() {
        let failed = |chunk: Option<&str>| FailedTurn {
            conversation_id: "c".into(),
            turn_id: "t".into(),
            model: "m".into(),
            sealed_at: 1,
            error_chunk: chunk.map(str::to_owned),
        };
        let whole = recent_error(failed(Some(r#"{"type":"error","message":"gone","code":"upstream"}"#)));
        assert_eq!((whole.message.as_str(), whole.code.as_deref()), ("gone", Some("upstream")));
        let cut = recent_error(failed(Some(r#"{"type":"error","message":"aaaa"#)));
        assert!(cut.message.starts_with("(an error too long to list"), "{}", cut.message);
        assert_eq!(recent_error(failed(None)).message, "");
    }

    #[test]
    fn quantiles_interpolate_within_a_class_as_prometheus_does() {
        let mut classes = [0; TTFT_BOUNDS_MS.len() + 1];
        assert_eq!(quantile(0.5, &classes), None);
        // Ten turns between 100 and 250 ms: the median halfway, p95 near the top.
        classes[3] = 10;
        assert_eq!(quantile(0.5, &classes), Some(175.0));
        assert_eq!(quantile(0.95, &classes), Some(242.5));
        // One slower than the last bound: the last bound.
        let mut slow = [0; TTFT_BOUNDS_MS.len() + 1];
        slow[TTFT_BOUNDS_MS.len()] = 1;
        assert_eq!(quantile(0.5, &slow), Some(120_000.0));
    }
}
