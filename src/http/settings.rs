//! A conversation's settings, which a turn falls back to when its request names none: the
//! sticky model, the working directory and the reasoning effort; and the language-server
//! panel of the reference web client (the gateway runs none). Each answers for unknown ids
//! too: a GET is null, a PUT creates the conversation. And the agent session a turn resumes,
//! which can be forgotten.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;

use super::AppState;
use super::error::ApiError;
#[cfg(feature = "openapi")]
use super::error::ErrorBody;
use super::extract::{Caller, ConversationId, JsonObject, SeenId};
use crate::runtime::REASONING_EFFORTS;
use crate::store::{Setting, StoreError, now_ms};
use crate::turn::StartError;

/// Documents the body of `PUT /conversations/:id/model`.
#[cfg(feature = "openapi")]
#[derive(Debug, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct ModelRequest {
    /// `<credential>/<model>`, or null to clear.
    pub model: Option<String>,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ModelResponse {
    pub conversation_id: String,
    /// Null when the conversation has no sticky model.
    pub model: Option<String>,
}

/// Documents the body of `PUT /conversations/:id/cwd`.
#[cfg(feature = "openapi")]
#[derive(Debug, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct CwdRequest {
    /// A directory (trimmed; at most 4096 bytes, no NUL), or null or blank to clear.
    pub cwd: Option<String>,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct CwdResponse {
    pub conversation_id: String,
    /// Null when unset: a turn then runs in its credential's folder, else the gateway's.
    pub cwd: Option<String>,
}

/// Documents the body of `PUT /conversations/:id/reasoning-effort`.
#[cfg(feature = "openapi")]
#[derive(Debug, utoipa::ToSchema)]
#[allow(dead_code)]
#[serde(rename_all = "camelCase")]
pub struct ReasoningEffortRequest {
    /// `low`, `medium`, `high`, `xhigh`, `max`, or null to clear.
    pub reasoning_effort: Option<String>,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ReasoningEffortResponse {
    pub conversation_id: String,
    /// Null when unset: agent programs are then told `high`; `openai` models get none.
    pub reasoning_effort: Option<String>,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct LspResponse {
    pub conversation_id: String,
    pub cwd: Option<String>,
    /// Always empty: the gateway runs no language servers.
    pub servers: Vec<serde_json::Value>,
}

/// Longest `cwd` accepted.
const MAX_CWD: usize = 4096;

/// A request's working directory, trimmed (blank is none) and checked: agent programs are
/// started in it, and the system refuses a path with a NUL or past its length.
pub fn check_cwd(cwd: Option<&str>) -> Result<Option<&str>, ApiError> {
    let cwd = cwd.map(str::trim).filter(|c| !c.is_empty());
    if cwd.is_some_and(|c| c.len() > MAX_CWD || c.contains('\0')) {
        return Err(ApiError::bad(format!("`cwd` must be a path of at most {MAX_CWD} bytes")));
    }
    Ok(cwd)
}

/// A request's reasoning effort, checked.
pub fn check_effort(effort: &str) -> Result<(), ApiError> {
    if REASONING_EFFORTS.contains(&effort) {
        return Ok(());
    }
    Err(ApiError::bad(format!("`reasoningEffort` takes low, medium, high, xhigh or max (or null), got {effort:?}")))
}

/// The value a PUT sets: the field must be present, a string or null.
fn put_value<'b>(body: &'b JsonObject, field: &str) -> Result<Option<&'b str>, ApiError> {
    if !body.0.contains_key(field) {
        return Err(ApiError::bad(format!("`{field}` is required (a string, or null to clear)")));
    }
    body.optional_str(field)
}

/// The conversation's sticky model.
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/conversations/{id}/model",
    tag = "conversations",
    params(("id" = String, Path, description = "Conversation id")),
    responses((status = 200, body = ModelResponse), (status = 400, body = ErrorBody))
))]
pub async fn get_model(State(state): State<AppState>, seen: SeenId) -> Result<Json<ModelResponse>, ApiError> {
    let id = seen.id;
    // Another subject's conversation reads as an unknown one: nothing set.
    let model = if seen.visible { state.store.setting(&id, Setting::Model).await? } else { None };
    Ok(Json(ModelResponse { conversation_id: id, model }))
}

/// Sets or clears the sticky model (a turn that names a known model sets it too).
#[cfg_attr(feature = "openapi", utoipa::path(
    put,
    path = "/conversations/{id}/model",
    tag = "conversations",
    params(("id" = String, Path, description = "Conversation id")),
    request_body = ModelRequest,
    responses((status = 200, body = ModelResponse), (status = 400, body = ErrorBody), (status = 409, description = "The conversation is being deleted", body = ErrorBody), (status = 413, body = ErrorBody))
))]
pub async fn put_model(
    State(state): State<AppState>,
    ConversationId(id): ConversationId,
    Caller(caller): Caller,
    body: JsonObject,
) -> Result<Json<ModelResponse>, ApiError> {
    let model = put_value(&body, "model")?;
    if let Some(m) = model
        && !state.turns.registry().contains(m)
    {
        return Err(StartError::UnknownModel(m.to_owned()).into());
    }
    state.store.set_setting(&id, Setting::Model, model, caller.owner(), now_ms()).await?;
    Ok(Json(ModelResponse { conversation_id: id, model: model.map(str::to_owned) }))
}

/// The conversation's working directory.
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/conversations/{id}/cwd",
    tag = "conversations",
    params(("id" = String, Path, description = "Conversation id")),
    responses((status = 200, body = CwdResponse), (status = 400, body = ErrorBody))
))]
pub async fn get_cwd(State(state): State<AppState>, seen: SeenId) -> Result<Json<CwdResponse>, ApiError> {
    let id = seen.id;
    // Another subject's conversation reads as an unknown one: nothing set.
    let cwd = if seen.visible { state.store.setting(&id, Setting::Cwd).await? } else { None };
    Ok(Json(CwdResponse { conversation_id: id, cwd }))
}

/// Sets or clears the working directory agent programs of this conversation run in.
#[cfg_attr(feature = "openapi", utoipa::path(
    put,
    path = "/conversations/{id}/cwd",
    tag = "conversations",
    params(("id" = String, Path, description = "Conversation id")),
    request_body = CwdRequest,
    responses((status = 200, body = CwdResponse), (status = 400, body = ErrorBody), (status = 409, description = "The conversation is being deleted", body = ErrorBody), (status = 413, body = ErrorBody))
))]
pub async fn put_cwd(
    State(state): State<AppState>,
    ConversationId(id): ConversationId,
    Caller(caller): Caller,
    body: JsonObject,
) -> Result<Json<CwdResponse>, ApiError> {
    let cwd = check_cwd(put_value(&body, "cwd")?)?;
    // Checked against the folders of the model the conversation's next turn runs on (checked
    // again when a turn starts: the model, or the folder, may change meanwhile).
    if let Some(asked) = cwd {
        let model = state.store.setting(&id, Setting::Model).await?;
        let registry = state.turns.registry();
        let model = model.unwrap_or_else(|| registry.default_model().to_owned());
        if let Some((runtime, _)) = registry.resolve(&model)
            && runtime.folder(asked).is_none()
        {
            return Err(crate::turn::StartError::Folder(asked.to_owned()).into());
        }
    }
    state.store.set_setting(&id, Setting::Cwd, cwd, caller.owner(), now_ms()).await?;
    Ok(Json(CwdResponse { conversation_id: id, cwd: cwd.map(str::to_owned) }))
}

/// The conversation's reasoning effort.
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/conversations/{id}/reasoning-effort",
    tag = "conversations",
    params(("id" = String, Path, description = "Conversation id")),
    responses((status = 200, body = ReasoningEffortResponse), (status = 400, body = ErrorBody))
))]
pub async fn get_reasoning_effort(
    State(state): State<AppState>,
    seen: SeenId,
) -> Result<Json<ReasoningEffortResponse>, ApiError> {
    let id = seen.id;
    // Another subject's conversation reads as an unknown one: nothing set.
    let reasoning_effort = if seen.visible { state.store.setting(&id, Setting::ReasoningEffort).await? } else { None };
    Ok(Json(ReasoningEffortResponse { conversation_id: id, reasoning_effort }))
}

/// Sets or clears the reasoning effort turns of this conversation ask for.
#[cfg_attr(feature = "openapi", utoipa::path(
    put,
    path = "/conversations/{id}/reasoning-effort",
    tag = "conversations",
    params(("id" = String, Path, description = "Conversation id")),
    request_body = ReasoningEffortRequest,
    responses((status = 200, body = ReasoningEffortResponse), (status = 400, body = ErrorBody), (status = 409, description = "The conversation is being deleted", body = ErrorBody), (status = 413, body = ErrorBody))
))]
pub async fn put_reasoning_effort(
    State(state): State<AppState>,
    ConversationId(id): ConversationId,
    Caller(caller): Caller,
    body: JsonObject,
) -> Result<Json<ReasoningEffortResponse>, ApiError> {
    let effort = put_value(&body, "reasoningEffort")?;
    if let Some(e) = effort {
        check_effort(e)?;
    }
    state.store.set_setting(&id, Setting::ReasoningEffort, effort, caller.owner(), now_ms()).await?;
    Ok(Json(ReasoningEffortResponse { conversation_id: id, reasoning_effort: effort.map(str::to_owned) }))
}

/// The language servers of the conversation's folder: none (the reference web client shows
/// this panel on every page).
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/conversations/{id}/lsp",
    tag = "conversations",
    params(("id" = String, Path, description = "Conversation id")),
    responses((status = 200, body = LspResponse), (status = 400, body = ErrorBody))
))]
pub async fn lsp(State(state): State<AppState>, seen: SeenId) -> Result<Json<LspResponse>, ApiError> {
    let id = seen.id;
    // Another subject's conversation reads as an unknown one: nothing set.
    let cwd = if seen.visible { state.store.setting(&id, Setting::Cwd).await? } else { None };
    Ok(Json(LspResponse { conversation_id: id, cwd, servers: Vec::new() }))
}

/// Forgets the agent session the conversation's next turn would resume: that turn starts a
/// new one (a new agent process), without what the agent program kept of the earlier turns.
/// The way on for a session that cannot be resumed (Claude Code's, after the conversation
/// moved to another folder); the log stays.
#[cfg_attr(feature = "openapi", utoipa::path(
    delete,
    path = "/conversations/{id}/session",
    tag = "conversations",
    params(("id" = String, Path, description = "Conversation id")),
    responses(
        (status = 204, description = "Forgotten (or there was none): the next turn starts a new session"),
        (status = 400, body = ErrorBody),
        (status = 404, description = "Unknown conversation, or one being deleted", body = ErrorBody),
        (status = 409, description = "A turn is running", body = ErrorBody),
    )
))]
pub async fn forget_session(
    State(state): State<AppState>,
    ConversationId(id): ConversationId,
) -> Result<StatusCode, ApiError> {
    match state.store.forget_session(&id).await {
        Ok(true) => Ok(StatusCode::NO_CONTENT),
        Ok(false) => Err(ApiError::NotFound(format!("no conversation {id:?}"))),
        Err(StoreError::Busy) => Err(ApiError::Conflict("a turn is running in this conversation".into())),
        Err(e) => Err(e.into()),
    }
}
