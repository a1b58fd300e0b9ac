//! `/auth/session`: browser sessions (docs/identity.md). A page trades a token or key for the
//! `dispatch_session` cookie once (HttpOnly: its scripts never hold it; SameSite=Strict: other
//! sites' pages never send it), then reads, streams and sends with nothing but the cookie.
//! The cookie names a session kept in the database (`store/sessions.rs`), so `DELETE` ends it
//! on every gateway.

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Serialize;

use super::AppState;
use super::error::ApiError;
#[cfg(feature = "openapi")]
use super::error::ErrorBody;
use super::extract::JsonObject;
use crate::identity::{Identity, KEY_SESSION_SECS};
use crate::store::{StoredSession, now_ms};

/// The session cookie's name.
pub const COOKIE: &str = "dispatch_session";

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SessionInfo {
    pub subject: String,
    pub admin: bool,
    /// When the credential stops being valid, in ms since the epoch (none: a key's, which does
    /// not expire, or auth off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<i64>,
}

#[cfg(feature = "openapi")]
#[derive(Debug, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct SessionRequest {
    /// A signed token or an API key.
    pub token: String,
}

/// Who the request's credential (header, `?access_token=` or cookie) says it comes from.
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/auth/session",
    tag = "auth",
    responses((status = 200, body = SessionInfo), (status = 401, body = ErrorBody))
))]
pub async fn get_session(
    caller: Option<Extension<Identity>>,
    failure: Option<Extension<std::sync::Arc<crate::identity::AuthError>>>,
) -> Response {
    let Some(Extension(caller)) = caller else {
        return match failure {
            Some(Extension(e)) => super::error::refusal(&e),
            None => super::error::refusal(&crate::identity::AuthError::Missing),
        };
    };
    Json(SessionInfo {
        subject: caller.subject.to_string(),
        admin: caller.admin,
        expires_at: caller.expires_at.map(|s| (s as i64).saturating_mul(1000)),
    })
    .into_response()
}

/// Signs a browser in: the token (or key) is checked, and the answer sets the session cookie,
/// valid until the token's `exp` (a key's: 12 hours).
#[cfg_attr(feature = "openapi", utoipa::path(
    post,
    path = "/auth/session",
    tag = "auth",
    request_body = SessionRequest,
    responses(
        (status = 204, description = "Signed in: `Set-Cookie: dispatch_session=...; HttpOnly; SameSite=Strict; Path=/`"),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
    )
))]
pub async fn begin_session(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: JsonObject,
) -> Result<Response, ApiError> {
    let token = body.required_str("token")?.trim();
    if !state.auth.enabled() {
        // Auth is off: there is nobody to be.
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    let identity = state.auth.identify(token).await.map_err(|e| ApiError::Unauthorized(e.to_string()))?;
    let now = now_ms();
    // Until the credential's own end, and at most 12 hours for a key.
    let key_session = now + (KEY_SESSION_SECS * 1000) as i64;
    let expires_at = match identity.expires_at {
        Some(exp) if identity.credential.starts_with(crate::identity::KEY_SUBJECT_PREFIX) => {
            (exp as i64).saturating_mul(1000).min(key_session)
        }
        Some(exp) => (exp as i64).saturating_mul(1000),
        None => key_session,
    };
    let id = random_id();
    // A session remembers what made it (so that taking that back ends it) and its quotas.
    let session = StoredSession {
        subject: identity.subject.to_string(),
        admin: identity.admin,
        expires_at,
        credential: identity.credential.to_string(),
        quotas: identity.quotas.map(|q| serde_json::to_string(&q).expect("quotas serialize")),
    };
    state.store.begin_session(&crate::identity::session_hash(&id), &session, now).await?;
    tracing::info!(target: "dispatch::audit", subject = %crate::log_text::Escaped(&identity.subject), admin = identity.admin, "signed in");
    let max_age = ((expires_at - now) / 1000).max(0);
    let secure = if secure_request(&state, &headers) { "; Secure" } else { "" };
    let cookie = format!("{COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age}{secure}");
    let mut response = StatusCode::NO_CONTENT.into_response();
    response.headers_mut().insert(header::SET_COOKIE, HeaderValue::from_str(&cookie).expect("a cookie is ASCII"));
    Ok(response)
}

/// Signs a browser out: its session ends (on every gateway) and the cookie is cleared.
#[cfg_attr(feature = "openapi", utoipa::path(
    delete,
    path = "/auth/session",
    tag = "auth",
    responses((status = 204, description = "Signed out (also when there was no session)"))
))]
pub async fn end_session(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, ApiError> {
    if let Some(id) = session_cookie(&headers) {
        let hash = crate::identity::session_hash(id);
        state.auth.end_session(&hash).await?;
    }
    let secure = if secure_request(&state, &headers) { "; Secure" } else { "" };
    let cookie = format!("{COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0{secure}");
    let mut response = StatusCode::NO_CONTENT.into_response();
    response.headers_mut().insert(header::SET_COOKIE, HeaderValue::from_str(&cookie).expect("a cookie is ASCII"));
    Ok(response)
}

/// The session cookie's value, if the request carries one.
pub(super) fn session_cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.trim())
        .filter(|v| !v.is_empty())
}

/// Whether the browser reached the gateway over TLS: a proxy the operator trusts says so.
fn secure_request(state: &AppState, headers: &HeaderMap) -> bool {
    state.config.trust_forwarded_proto
        && headers.get("x-forwarded-proto").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"))
}

/// 32 random bytes, URL-safe base64: what the cookie holds.
fn random_id() -> String {
    use base64::Engine;
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 32];
    ring::rand::SystemRandom::new().fill(&mut bytes).expect("the system's random source works");
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}
