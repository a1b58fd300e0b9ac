//! Request parsing with the gateway's own error sentences: JSON bodies, path ids,
//! query parameters.

use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::header::CONTENT_LENGTH;
use axum::http::request::Parts;
use http_body_util::LengthLimitError;
use serde_json::{Map, Value};

use super::AppState;
use super::error::ApiError;
use crate::identity::Identity;
use crate::store::Ownership;

/// Why a body could not be read: past the limit (413), not in time (408), or cut (400).
pub(super) fn body_error(e: axum::Error, limit: usize) -> ApiError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(e) = source {
        if e.is::<LengthLimitError>() {
            return ApiError::TooLarge(limit);
        }
        if e.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::TimedOut) {
            return ApiError::SlowBody("the request body did not arrive in time".into());
        }
        source = e.source();
    }
    ApiError::bad("could not read the request body")
}

/// A request body that must be a JSON object.
pub struct JsonObject(pub Map<String, Value>);

impl FromRequest<AppState> for JsonObject {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let limit = state.config.max_body_bytes;
        let declared =
            req.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(ApiError::TooLarge(limit));
        }
        let bytes = axum::body::to_bytes(req.into_body(), limit).await.map_err(|e| body_error(e, limit))?;
        match serde_json::from_slice::<Value>(&bytes) {
            Ok(Value::Object(map)) => Ok(JsonObject(map)),
            Ok(_) => Err(ApiError::bad("Request body must be a JSON object")),
            Err(_) => Err(ApiError::bad("Invalid JSON body")),
        }
    }
}

impl JsonObject {
    /// A string field that must be present.
    pub fn required_str(&self, name: &str) -> Result<&str, ApiError> {
        match self.0.get(name) {
            None | Some(Value::Null) => Err(ApiError::bad(format!("`{name}` is required"))),
            Some(Value::String(s)) => Ok(s),
            Some(_) => Err(ApiError::bad(format!("`{name}` must be a string"))),
        }
    }

    /// A string field that may be absent or null.
    pub fn optional_str(&self, name: &str) -> Result<Option<&str>, ApiError> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(ApiError::bad(format!("`{name}` must be a string"))),
        }
    }

    /// A trimmed, non-empty message field.
    pub fn message(&self, name: &str) -> Result<String, ApiError> {
        let text = self.required_str(name)?.trim();
        if text.is_empty() {
            return Err(ApiError::bad(format!("`{name}` must not be empty")));
        }
        Ok(text.to_owned())
    }

    /// An optional conversation id, checked like a path id.
    pub fn conversation_id(&self, name: &str) -> Result<Option<String>, ApiError> {
        self.optional_str(name)?
            .map(|id| check_id(id).map(str::to_owned).map_err(|e| ApiError::bad(format!("`{name}`: {e}"))))
            .transpose()
    }
}

/// Conversation ids are client-chosen: 1 to 128 characters of `[A-Za-z0-9._:-]`.
pub fn check_id(id: &str) -> Result<&str, String> {
    if id.is_empty() || id.len() > 128 {
        return Err("a conversation id has 1 to 128 characters".into());
    }
    if !id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-')) {
        return Err("a conversation id may only contain A-Z, a-z, 0-9, '.', '_', ':' and '-'".into());
    }
    Ok(id)
}

/// The `:id` of a `/conversations/:id...` path, validated.
/// Who calls: the identity `layers::authenticate` found.
pub struct Caller(pub Identity);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Identity>()
            .cloned()
            .map(Caller)
            .ok_or_else(|| ApiError::Unauthorized("this route needs an API key or a token".into()))
    }
}

/// The conversation id of the path and the caller, whose sight of it the route checks itself
/// (a read that checks it in its own query: `GET /conversations/{id}`).
pub struct ReadId {
    pub id: String,
    pub caller: Identity,
}

impl<S: Send + Sync> FromRequestParts<S> for ReadId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Path(id) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|_| ApiError::bad("invalid conversation id in the path"))?;
        check_id(&id).map_err(ApiError::BadRequest)?;
        let Caller(caller) = Caller::from_request_parts(parts, state).await?;
        Ok(ReadId { id, caller })
    }
}

/// The conversation id of the path, and whether the caller may see that conversation: an
/// administrator sees all, a user their own and ids nobody has used.
async fn path_id(parts: &mut Parts, state: &AppState) -> Result<(String, Identity, bool), ApiError> {
    let ReadId { id, caller } = ReadId::from_request_parts(parts, state).await?;
    let visible = match caller.viewer() {
        None => true,
        Some(_) => match state.store.ownership(&id).await? {
            Ownership::Unused => true,
            Ownership::Owned(owner) => caller.may_see(owner.as_deref()),
        },
    };
    Ok((id, caller, visible))
}

/// A conversation id the caller may use: another subject's conversation is answered 404, as an
/// unknown one is by the routes that take this (docs/identity.md).
pub struct ConversationId(pub String);

impl FromRequestParts<AppState> for ConversationId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        match path_id(parts, state).await? {
            (id, _, true) => Ok(ConversationId(id)),
            (id, _, false) => Err(ApiError::NotFound(format!("no conversation {id:?}"))),
        }
    }
}

/// A conversation id read by a route that answers an unknown id with an empty answer: the
/// route gives that answer when `visible` is false (another subject's conversation).
pub struct SeenId {
    pub id: String,
    pub visible: bool,
    pub caller: Identity,
}

impl FromRequestParts<AppState> for SeenId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let (id, caller, visible) = path_id(parts, state).await?;
        Ok(SeenId { id, visible, caller })
    }
}

/// The query string as name/value pairs (a repeated name: the last value wins).
pub struct QueryParams(Vec<(String, String)>);

impl<S: Send + Sync> FromRequestParts<S> for QueryParams {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let query = parts.uri.query().unwrap_or("");
        Ok(QueryParams(form_urlencoded::parse(query.as_bytes()).into_owned().collect()))
    }
}

impl QueryParams {
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// An optional integer parameter from `min` to `max`; anything else is 400 naming it.
    pub fn integer(&self, name: &str, min: u64, max: u64) -> Result<Option<u64>, ApiError> {
        let Some(raw) = self.get(name) else {
            return Ok(None);
        };
        let bound = if min == 0 { "an integer >= 0" } else { "an integer > 0" };
        let not_an_integer = || ApiError::bad(format!("`{name}` must be {bound}, got {raw:?}"));
        // Too large, whether it fits in 64 bits or not.
        let too_large = || ApiError::bad(format!("`{name}` must be at most {max}, got {raw:?}"));
        match raw.parse::<u64>() {
            Ok(value) if value < min => Err(not_an_integer()),
            Ok(value) if value > max => Err(too_large()),
            Ok(value) => Ok(Some(value)),
            Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => Err(too_large()),
            Err(_) => Err(not_an_integer()),
        }
    }
}
