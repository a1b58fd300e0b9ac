//! `GET /metrics/throughput`: output tokens per second of generation, per model, over a day,
//! an ISO week or a month (UTC).

use axum::Json;
use axum::extract::State;
use serde::Serialize;

use super::AppState;
use super::error::ApiError;
#[cfg(feature = "openapi")]
use super::error::ErrorBody;
use super::extract::{Caller, QueryParams};
use crate::store::now_ms;

const DAY_MS: i64 = 86_400_000;

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ModelRate {
    pub model: String,
    /// Output tokens over generation seconds, summed over the period's turns (so weighted by
    /// tokens).
    pub tokens_per_second: f64,
    pub total_output_tokens: i64,
    pub total_gen_ms: i64,
    pub turns: i64,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Throughput {
    /// `day`, `week` or `month`.
    pub period: String,
    /// The day (`YYYY-MM-DD`) or month (`YYYY-MM`) asked for.
    pub date: String,
    /// Start of the period, epoch ms (inclusive).
    pub start: i64,
    /// End of the period, epoch ms (exclusive).
    pub end: i64,
    /// Fastest first.
    pub models: Vec<ModelRate>,
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn days_in_month(y: i64, m: i64) -> i64 {
    let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
    days_from_civil(ny, nm, 1) - days_from_civil(y, m, 1)
}

/// Parses `YYYY-MM-DD` (day required) or `YYYY-MM` into (year, month, day?).
fn parse_date(s: &str) -> Option<(i64, i64, Option<i64>)> {
    let parts: Vec<&str> = s.split('-').collect();
    let num =
        |p: &str, len: usize| (p.len() == len && p.bytes().all(|b| b.is_ascii_digit())).then(|| p.parse().ok())?;
    let (y, m) = (num(parts.first()?, 4)?, num(parts.get(1)?, 2)?);
    if !(1..=12).contains(&m) {
        return None;
    }
    match parts.len() {
        2 => Some((y, m, None)),
        3 => {
            let d = num(parts[2], 2)?;
            (1..=days_in_month(y, m)).contains(&d).then_some((y, m, Some(d)))
        }
        _ => None,
    }
}

/// Output throughput per model over a period.
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/metrics/throughput",
    tag = "operations",
    params(
        ("period" = Option<String>, Query, description = "`day` (default), `week` (ISO, Monday first) or `month`"),
        ("date" = Option<String>, Query, description = "`YYYY-MM-DD`, or `YYYY-MM` for a month; default today (UTC). A user's answer counts their own turns"),
    ),
    responses((status = 200, body = Throughput), (status = 400, body = ErrorBody))
))]
pub async fn throughput(
    State(state): State<AppState>,
    Caller(caller): Caller,
    query: QueryParams,
) -> Result<Json<Throughput>, ApiError> {
    let Period { period, date, start, end } = period(&query)?;
    let mut models: Vec<ModelRate> = state
        .store
        // A user counts their own turns; an administrator everyone's.
        .throughput(start, end, caller.viewer().map(|v| &**v))
        .await?
        .into_iter()
        .map(|r| ModelRate {
            tokens_per_second: if r.gen_ms > 0 { r.output_tokens as f64 * 1000.0 / r.gen_ms as f64 } else { 0.0 },
            model: r.model,
            total_output_tokens: r.output_tokens,
            total_gen_ms: r.gen_ms,
            turns: r.turns,
        })
        .collect();
    models.sort_by(|a, b| b.tokens_per_second.total_cmp(&a.tokens_per_second).then_with(|| a.model.cmp(&b.model)));
    Ok(Json(Throughput { period: period.to_owned(), date, start, end, models }))
}

/// A period a query asks for (`period`, `date`): its name, the date as asked, and its bounds.
pub(super) struct Period {
    pub period: &'static str,
    pub date: String,
    pub start: i64,
    pub end: i64,
}

/// `?period=day|week|month&date=` (default: today, UTC), each refused with why.
pub(super) fn period(query: &QueryParams) -> Result<Period, ApiError> {
    let period = match query.get("period").unwrap_or("day") {
        "day" => "day",
        "week" => "week",
        "month" => "month",
        other => return Err(ApiError::bad(format!("`period` takes day, week or month, got {other:?}"))),
    };
    let today = civil_from_days(now_ms().div_euclid(DAY_MS));
    let (y, m, d) = match query.get("date") {
        None => (today.0, today.1, Some(today.2)),
        Some(raw) => parse_date(raw).ok_or_else(|| {
            ApiError::bad(format!("`date` must be a real date as YYYY-MM-DD (or YYYY-MM for a month), got {raw:?}"))
        })?,
    };
    let (date, first_day, days) = match (period, d) {
        ("month", _) => (format!("{y:04}-{m:02}"), days_from_civil(y, m, 1), days_in_month(y, m)),
        (_, None) => return Err(ApiError::bad("`date` must be YYYY-MM-DD for a day or a week")),
        ("week", Some(d)) => {
            let day = days_from_civil(y, m, d);
            // 1970-01-01 was a Thursday: Monday-based weekday is (days + 3) mod 7.
            (format!("{y:04}-{m:02}-{d:02}"), day - (day + 3).rem_euclid(7), 7)
        }
        (_, Some(d)) => (format!("{y:04}-{m:02}-{d:02}"), days_from_civil(y, m, d), 1),
    };
    let (start, end) = (first_day * DAY_MS, (first_day + days) * DAY_MS);
    Ok(Period { period, date, start, end })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates_round_trip() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2026, 11, 29), 20_786);
        for z in [-800_000, -1, 0, 1, 11_016, 20_786, 100_000] {
            let (y, m, d) = civil_from_days(z);
            assert_eq!(days_from_civil(y, m, d), z);
        }
        assert_eq!(days_in_month(2024, 2), 29);
        assert_eq!(days_in_month(2100, 2), 28);
        assert_eq!(parse_date("2026-02-29"), None);
        assert_eq!(parse_date("2024-02-29"), Some((2024, 2, Some(29))));
        assert_eq!(parse_date("2026-13"), None);
        assert_eq!(parse_date("2026-1-01"), None);
        assert_eq!(parse_date("2026-11"), Some((2026, 11, None)));
    }
}
