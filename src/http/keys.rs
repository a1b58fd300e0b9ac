//! `/keys`: API keys made at runtime, and `/auth/sessions`: ending a subject's sessions
//! (docs/identity.md). Administrators only. A made key's secret is answered once, by `POST`;
//! the database keeps its SHA-256. Revoking a key, or a subject's sessions, ends what they
//! opened: on this gateway at once, on the others within two seconds.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use serde::Serialize;
use serde_json::Value;

use super::AppState;
use super::error::ApiError;
#[cfg(feature = "openapi")]
use super::error::ErrorBody;
use super::extract::{Caller, JsonObject, QueryParams};
use crate::config::Quotas;
use crate::identity::{Identity, NewKey};
use crate::store::StoredKey;

/// Longest name of a key, in bytes.
const MOST_NAME_BYTES: usize = 200;

/// A made key as listed (never its secret).
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct KeyInfo {
    pub id: String,
    pub name: String,
    /// `key:<id>`: whose conversations the key's turns are.
    pub subject: String,
    pub admin: bool,
    /// Replace the configured `[quotas]` for this key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quotas: Option<Value>,
    /// In ms since the epoch.
    pub created_at: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<i64>,
    /// Noted at most once a minute.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_used_at: Option<i64>,
}

/// A key just made: `secret` is shown this once.
#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct NewKeyInfo {
    /// `dk_` and 32 random bytes, URL-safe base64: send it as `Authorization: Bearer`.
    pub secret: String,
    #[serde(flatten)]
    pub key: KeyInfo,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct KeyList {
    pub keys: Vec<KeyInfo>,
}

#[cfg(feature = "openapi")]
#[derive(Debug, utoipa::ToSchema)]
#[allow(dead_code)]
#[serde(rename_all = "camelCase")]
pub struct KeyRequest {
    pub name: String,
    /// An administrator's key (default false: a user, who sees only the key's own conversations).
    pub admin: Option<bool>,
    /// When the key stops working, in ms since the epoch (default: never).
    pub expires_at: Option<i64>,
    /// Replace `[quotas]` for this key.
    pub quotas: Option<Quotas>,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EndedSessions {
    /// How many sessions ended.
    pub ended: u64,
}

fn info(key: StoredKey) -> KeyInfo {
    KeyInfo {
        subject: format!("{}{}", crate::identity::KEY_SUBJECT_PREFIX, key.id),
        id: key.id,
        name: key.name,
        admin: key.admin,
        quotas: key.quotas.and_then(|q| serde_json::from_str(&q).ok()),
        created_at: key.created_at,
        expires_at: key.expires_at,
        last_used_at: key.last_used_at,
    }
}

fn administrator(caller: &Identity, auth_on: bool) -> Result<(), ApiError> {
    if !auth_on {
        return Err(ApiError::bad("keys need auth on (--api-keys or a token key): with auth off nobody needs one"));
    }
    if !caller.admin {
        return Err(ApiError::Forbidden(
            "keys and sessions are for administrators (an API key, or a token with the dispatch:admin scope)".into(),
        ));
    }
    Ok(())
}

/// The request's key to make, checked field by field.
fn new_key(body: &JsonObject) -> Result<NewKey, ApiError> {
    let name = body.required_str("name")?.trim();
    if name.is_empty() || name.len() > MOST_NAME_BYTES {
        return Err(ApiError::bad(format!("`name` must be 1 to {MOST_NAME_BYTES} bytes")));
    }
    let admin = match body.0.get("admin") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad("`admin` must be true or false")),
    };
    let expires_at = match body.0.get("expiresAt") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_i64() {
            Some(ms) if ms > crate::store::now_ms() => Some(ms),
            _ => return Err(ApiError::bad("`expiresAt` must be a time in the future, in ms since the epoch")),
        },
    };
    let quotas = match body.0.get("quotas") {
        None | Some(Value::Null) => None,
        Some(v) => Some(serde_json::from_value::<Quotas>(v.clone()).map_err(|e| {
            ApiError::bad(format!("`quotas`: {e} (concurrent_turns, turns_per_minute, streams, tokens_per_day)"))
        })?),
    };
    Ok(NewKey { name: name.to_owned(), admin, expires_at, quotas })
}

/// Makes a key; its secret is in this answer only.
#[cfg_attr(feature = "openapi", utoipa::path(
    post,
    path = "/keys",
    tag = "auth",
    request_body = KeyRequest,
    responses(
        (status = 201, body = NewKeyInfo),
        (status = 400, body = ErrorBody),
        (status = 403, description = "Not an administrator", body = ErrorBody),
    )
))]
pub async fn create(
    State(state): State<AppState>,
    Caller(caller): Caller,
    body: JsonObject,
) -> Result<(StatusCode, Json<NewKeyInfo>), ApiError> {
    administrator(&caller, state.auth.enabled())?;
    let made = state.auth.make_key(new_key(&body)?).await?;
    Ok((StatusCode::CREATED, Json(NewKeyInfo { secret: made.secret, key: info(made.key) })))
}

/// Every made key (never a secret).
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/keys",
    tag = "auth",
    responses(
        (status = 200, body = KeyList),
        (status = 400, description = "Auth is off: there are no keys to make", body = ErrorBody),
        (status = 403, body = ErrorBody),
    )
))]
pub async fn list(State(state): State<AppState>, Caller(caller): Caller) -> Result<Json<KeyList>, ApiError> {
    administrator(&caller, state.auth.enabled())?;
    let keys = state.store.list_keys().await?.into_iter().map(info).collect();
    Ok(Json(KeyList { keys }))
}

/// Revokes a key: refused from now on, and its sessions and streams end.
#[cfg_attr(feature = "openapi", utoipa::path(
    delete,
    path = "/keys/{id}",
    tag = "auth",
    params(("id" = String, Path, description = "The key's id")),
    responses(
        (status = 204, description = "Revoked"),
        (status = 400, description = "Auth is off: there are no keys to make", body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, description = "No such key", body = ErrorBody),
    )
))]
pub async fn revoke(
    State(state): State<AppState>,
    Caller(caller): Caller,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    administrator(&caller, state.auth.enabled())?;
    if state.auth.revoke_key(&id).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::NotFound(format!("no key {:?}", crate::log_text::Escaped(&id).to_string())))
    }
}

/// Ends every browser session of a subject (and the streams they opened).
#[cfg_attr(feature = "openapi", utoipa::path(
    delete,
    path = "/auth/sessions",
    tag = "auth",
    params(("subject" = String, Query, description = "Whose sessions end")),
    responses((status = 200, body = EndedSessions), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody))
))]
pub async fn end_sessions(
    State(state): State<AppState>,
    Caller(caller): Caller,
    query: QueryParams,
) -> Result<Json<EndedSessions>, ApiError> {
    administrator(&caller, state.auth.enabled())?;
    let subject =
        query.get("subject").filter(|s| !s.is_empty()).ok_or_else(|| ApiError::bad("`subject` is required"))?;
    let ended = state.auth.end_sessions_of(subject).await?;
    Ok(Json(EndedSessions { ended }))
}
