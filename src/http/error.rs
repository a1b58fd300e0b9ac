//! The one error type of the HTTP layer: every failure is `{"error": "<sentence>"}`.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::identity::AuthError;
use crate::store::StoreError;
use crate::turn::StartError;

/// The body of every error response.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: String,
}

/// The body of a 429: which quota was reached.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QuotaBody {
    pub error: String,
    /// `concurrent_turns`, `turns_per_minute`, `streams` or `tokens_per_day`.
    pub limit: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    /// 401: no credential, or one that is not valid (the sentence says which and why).
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    /// 421: the request names a host this gateway does not answer to (DNS rebinding).
    #[error("{0}")]
    MisdirectedHost(String),
    /// 415: a body that is not typed as JSON.
    #[error("{0}")]
    UnsupportedType(String),
    #[error("{0}")]
    Conflict(String),
    #[error("request body is larger than {0} bytes")]
    TooLarge(usize),
    /// 413 for what would pass a limit other than the body's.
    #[error("{0}")]
    LimitExceeded(String),
    /// 408: the request's body did not arrive in time.
    #[error("{0}")]
    SlowBody(String),
    #[error("{0}")]
    Unavailable(String),
    /// 503 because a cap (`--max-turns`, `--max-streams`) is reached: places free as turns and
    /// streams end, so the answer says when to try again.
    #[error("{0}")]
    AtCapacity(String),
    /// 429: past one of the caller's quotas.
    #[error("{}", .0.message)]
    Quota(crate::identity::QuotaExceeded),
    /// The detail is logged, never sent.
    #[error("internal error")]
    Internal(String),
}

impl ApiError {
    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError::BadRequest(message.into())
    }

    fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Quota(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MisdirectedHost(_) => StatusCode::MISDIRECTED_REQUEST,
            ApiError::UnsupportedType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::TooLarge(_) | ApiError::LimitExceeded(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::SlowBody(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Unavailable(_) | ApiError::AtCapacity(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// Marks a 5xx answer that is the expected state of things (`/ready` while draining): logged at
/// info, not as a failure.
#[derive(Debug, Clone, Copy)]
pub struct Expected;

/// What went wrong inside a request answered 500, carried on the response to the request's log
/// line (`layers::trace`), never sent.
#[derive(Debug, Clone)]
pub struct InternalDetail(pub String);

/// Seconds a client is asked to wait (`Retry-After`) before trying again past a cap: long
/// enough that a crowd of retries does not take the capacity it waits for, short next to a turn.
pub const RETRY_AFTER_SECS: u32 = 5;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let ApiError::Quota(q) = self {
            let body = QuotaBody { error: q.message, limit: q.limit.to_owned() };
            let mut response = (StatusCode::TOO_MANY_REQUESTS, Json(body)).into_response();
            let seconds = q.retry_after_secs.min(u64::from(u32::MAX)) as u32;
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, seconds.into());
            return response;
        }
        let mut response = (self.status(), Json(ErrorBody { error: self.to_string() })).into_response();
        match self {
            ApiError::Internal(detail) => {
                response.extensions_mut().insert(InternalDetail(detail));
            }
            ApiError::AtCapacity(_) => {
                response.headers_mut().insert(axum::http::header::RETRY_AFTER, RETRY_AFTER_SECS.into());
            }
            _ => {}
        }
        response
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Exists => ApiError::Conflict("a conversation with this id already exists".into()),
            StoreError::Busy => ApiError::Conflict(StoreError::Busy.to_string()),
            e @ (StoreError::Deleting | StoreError::DeletedDuringRead) => ApiError::Conflict(e.to_string()),
            StoreError::Unwritable(why) => ApiError::Unavailable(format!("the database cannot take writes now: {why}")),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

impl From<StartError> for ApiError {
    fn from(e: StartError) -> Self {
        match e {
            StartError::UnknownModel(m) => ApiError::BadRequest(format!("unknown model {m:?}; GET /models lists them")),
            e @ StartError::Folder(_) => ApiError::BadRequest(e.to_string()),
            StartError::Busy => ApiError::Conflict(StartError::Busy.to_string()),
            e @ StartError::NotFound(_) => ApiError::NotFound(e.to_string()),
            StartError::Quota(q) => ApiError::Quota(q),
            e @ StartError::ShuttingDown => ApiError::Unavailable(e.to_string()),
            e @ StartError::Full(_) => ApiError::AtCapacity(e.to_string()),
            StartError::QueueFull(full @ crate::runtime::QueueFull::Messages(_)) => {
                ApiError::Conflict(StartError::QueueFull(full).to_string())
            }
            StartError::QueueFull(full @ crate::runtime::QueueFull::Bytes(_)) => {
                ApiError::LimitExceeded(StartError::QueueFull(full).to_string())
            }
            StartError::Store(e) => e.into(),
        }
    }
}

impl From<crate::identity::QuotaError> for ApiError {
    fn from(e: crate::identity::QuotaError) -> Self {
        match e {
            crate::identity::QuotaError::Exceeded(q) => ApiError::Quota(q),
            crate::identity::QuotaError::Store(e) => e.into(),
        }
    }
}

/// The 401 for a request without a valid credential, with its challenge (RFC 6750): a bare
/// `Bearer` when there was none, `invalid_token` when there was a bad one.
pub(super) fn refusal(e: &AuthError) -> Response {
    let challenge = match e {
        AuthError::Missing => "Bearer",
        AuthError::Invalid(_) => "Bearer error=\"invalid_token\"",
        // The key may be fine: never "sign in again" for what the database could not say.
        AuthError::Unavailable(why) => return ApiError::Unavailable(why.clone()).into_response(),
    };
    let mut response = ApiError::Unauthorized(e.to_string()).into_response();
    response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
    response
}
