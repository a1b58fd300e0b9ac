//! `/conversations`: create, list, history, metrics, title, delete.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use super::AppState;
use super::error::ApiError;
#[cfg(feature = "openapi")]
use super::error::ErrorBody;
use super::extract::{Caller, ConversationId, JsonObject, QueryParams, ReadId, SeenId, check_id};
use super::paged::{Document, json, paged};
use crate::store::{ConversationFilter, HistoryPage, HistoryWindow, NewConversation, Ownership, now_ms};
use crate::turn::StartError;
#[cfg(feature = "openapi")]
use crate::wire::StoredChunk;
use crate::wire::{ConversationMeta, ConversationStatus, TurnMetrics};

/// Longest title accepted, in characters.
const MAX_TITLE_CHARS: usize = 512;
/// `GET /conversations` returns at most this many when no `limit` is given.
const DEFAULT_LIST_LIMIT: u64 = 100;
const MAX_LIST_LIMIT: u64 = 1000;

/// Documents the body for OpenAPI; it is read field by field through `JsonObject`, so
/// each bad field gets its own error sentence.
#[cfg(feature = "openapi")]
#[derive(Debug, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct CreateConversation {
    /// Client-chosen id (1-128 of `[A-Za-z0-9._:-]`); a UUID is minted when absent.
    pub id: Option<String>,
    pub title: Option<String>,
    /// Sticky model for the conversation's turns.
    pub model: Option<String>,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ConversationList {
    pub conversations: Vec<ConversationMeta>,
    /// The gateway's: a full page may have more after it; `?cursor=` this reads the next.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
    /// The gateway's, with `?count=true`: how many conversations the filter finds in all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total: Option<u64>,
}

// Documents the body for OpenAPI; the handler writes it from the stored chunks' own JSON.
/// `GET /conversations/:id`: a window of the log.
#[cfg(feature = "openapi")]
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct HistoryResponse {
    pub chunks: Vec<StoredChunk>,
    /// Seq of the last chunk returned, or `sinceSeq` when none is.
    pub latest_seq: u64,
}

// Documents the body for OpenAPI; the handler writes it a page of turns at a time.
/// `GET /conversations/:id/metrics`.
#[cfg(feature = "openapi")]
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct MetricsResponse {
    /// Every sealed turn, in turn order.
    pub turns: Vec<TurnMetrics>,
}

/// Documents the body for OpenAPI; it is read field by field through `JsonObject`, so
/// each bad field gets its own error sentence.
#[cfg(feature = "openapi")]
#[derive(Debug, utoipa::ToSchema)]
#[allow(dead_code)]
pub struct TitleRequest {
    pub title: String,
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TitleResponse {
    pub conversation_id: String,
    pub title: String,
}

fn title_field(body: &JsonObject, required: bool) -> Result<Option<String>, ApiError> {
    let title = if required { Some(body.required_str("title")?) } else { body.optional_str("title")? };
    match title {
        Some(t) if t.chars().count() > MAX_TITLE_CHARS => {
            Err(ApiError::bad(format!("`title` must have at most {MAX_TITLE_CHARS} characters")))
        }
        // PostgreSQL's text cannot hold U+0000; no title needs one, on either backend.
        Some(t) if t.contains('\0') => Err(ApiError::bad("`title` must not contain U+0000")),
        t => Ok(t.map(|t| t.trim().to_owned())),
    }
}

/// Creates a conversation.
#[cfg_attr(feature = "openapi", utoipa::path(
    post,
    path = "/conversations",
    tag = "conversations",
    request_body = CreateConversation,
    responses(
        (status = 201, body = ConversationMeta),
        (status = 400, body = ErrorBody),
        (status = 409, description = "The id exists", body = ErrorBody),
        (status = 413, body = ErrorBody),
    )
))]
pub async fn create(
    State(state): State<AppState>,
    Caller(caller): Caller,
    body: JsonObject,
) -> Result<Response, ApiError> {
    let id = match body.optional_str("id")? {
        Some(id) => check_id(id).map_err(|e| ApiError::bad(format!("`id`: {e}")))?.to_owned(),
        None => uuid::Uuid::new_v4().to_string(),
    };
    let title = title_field(&body, false)?.unwrap_or_default();
    let model = body.optional_str("model")?;
    if let Some(m) = model
        && !state.turns.registry().contains(m)
    {
        return Err(StartError::UnknownModel(m.to_owned()).into());
    }
    let meta = state
        .store
        .create_conversation(NewConversation { id: &id, title: &title, model, owner: caller.owner(), now: now_ms() })
        .await?;
    state.turns.created(&id);
    Ok((StatusCode::CREATED, Json(meta)).into_response())
}

/// Lists conversations, newest activity first.
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/conversations",
    tag = "conversations",
    params(
        ("q" = Option<String>, Query, description = "Id prefix"),
        ("search" = Option<String>, Query, description = "Conversations whose title holds this text (A-Z in either case), or whose id starts with it (at most 512 characters)"),
        ("status" = Option<String>, Query, description = "Comma-separated statuses: active, idle, closed"),
        ("limit" = Option<u64>, Query, description = "At most this many (default 100, max 1000)"),
        ("owner" = Option<String>, Query, description = "Administrators: only this subject's conversations (a user sees only their own, whatever this says)"),
        ("cursor" = Option<String>, Query, description = "The page after the one whose `nextCursor` this is"),
        ("count" = Option<bool>, Query, description = "`true`: the answer says how many conversations the filter finds in all (`total`)"),
    ),
    responses((status = 200, body = ConversationList), (status = 400, body = ErrorBody))
))]
pub async fn list(
    State(state): State<AppState>,
    Caller(caller): Caller,
    query: QueryParams,
) -> Result<Json<ConversationList>, ApiError> {
    let limit = query.integer("limit", 1, MAX_LIST_LIMIT)?.unwrap_or(DEFAULT_LIST_LIMIT);
    let mut statuses = Vec::new();
    for s in query.get("status").unwrap_or("").split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let status = ConversationStatus::parse(s)
            .ok_or_else(|| ApiError::bad(format!("`status` takes active, idle or closed, got {s:?}")))?;
        statuses.push(status);
    }
    // An id prefix has an id's characters: anything else matches no id, and PostgreSQL's text
    // cannot even hold some of it (U+0000).
    let id_prefix = match query.get("q").filter(|q| !q.is_empty()) {
        Some(q) => Some(check_id(q).map_err(|e| ApiError::bad(format!("`q` is an id prefix: {e}")))?.to_owned()),
        None => None,
    };
    // A user lists their own; an administrator everyone's, or one subject's with `?owner=`.
    let owner = match caller.viewer() {
        Some(viewer) => Some(viewer.to_string()),
        // No subject holds U+0000 (PostgreSQL's text cannot: it would fail the read).
        None => match query.get("owner").filter(|o| !o.is_empty()) {
            Some(o) if o.contains('\0') => return Err(ApiError::bad("`owner` must not contain U+0000")),
            o => o.map(str::to_owned),
        },
    };
    let search = match query.get("search").map(str::trim).filter(|s| !s.is_empty()) {
        Some(s) if s.chars().count() > MAX_TITLE_CHARS => {
            return Err(ApiError::bad(format!("`search` has at most {MAX_TITLE_CHARS} characters")));
        }
        // No title holds U+0000 (PostgreSQL's text cannot).
        Some(s) if s.contains('\0') => return Err(ApiError::bad("`search` must not contain U+0000")),
        s => s.map(str::to_owned),
    };
    let after = query.get("cursor").map(parse_cursor).transpose()?;
    let count = match query.get("count") {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => return Err(ApiError::bad(format!("`count` takes true or false, got {other:?}"))),
    };
    let filter = ConversationFilter { id_prefix, search, statuses, owner, after, limit: limit as u32 };
    let conversations = state.store.list_conversations(&filter).await?;
    // A full page may have more after it (a page that ends the list exactly says so when the
    // next one comes back empty).
    let next_cursor = match conversations.last() {
        Some(last) if conversations.len() as u64 == limit => Some(format!("{}:{}", last.last_activity_at, last.id)),
        _ => None,
    };
    let total = if count { Some(state.store.count_conversations(&filter).await?) } else { None };
    Ok(Json(ConversationList { conversations, next_cursor, total }))
}

/// A list cursor, `<lastActivityAt>:<id>` of the row a page ended with. A conversation active
/// since moves to the front of the list, so paging meanwhile neither repeats nor skips the
/// rows that stayed put, and shows that one again only on a read from the start.
fn parse_cursor(raw: &str) -> Result<(i64, String), ApiError> {
    let bad = || ApiError::bad(format!("`cursor` is a list's `nextCursor`, got {raw:?}"));
    let (at, id) = raw.split_once(':').ok_or_else(bad)?;
    let at = at.parse::<i64>().map_err(|_| bad())?;
    Ok((at, check_id(id).map_err(|_| bad())?.to_owned()))
}

/// A window of the conversation's log. An unknown id is an empty log.
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/conversations/{id}",
    tag = "conversations",
    params(
        ("id" = String, Path, description = "Conversation id"),
        ("sinceSeq" = Option<u64>, Query, description = "Only chunks with seq > sinceSeq (integer >= 0, default 0)"),
        ("beforeSeq" = Option<u64>, Query, description = "Only chunks with seq < beforeSeq (integer > 0)"),
        ("limit" = Option<u64>, Query, description = "Keep the newest `limit` of the selection (integer > 0)"),
        ("include" = Option<String>, Query, description = "`inflight`: also the running turn's committed chunks (its user message, its finished steps). Without it a read shows sealed turns only: the running turn is the live stream's, never both"),
    ),
    responses((status = 200, description = "The sealed turns' chunks in the window (and the running turn's with `include=inflight`); `latestSeq` is the seq of the last one returned, or `sinceSeq`. A long read goes out in pages; one a deletion overtakes after the answer began is cut off before its end", body = HistoryResponse), (status = 400, body = ErrorBody), (status = 409, description = "The conversation was deleted while it was read", body = ErrorBody))
))]
pub async fn history(
    State(state): State<AppState>,
    ReadId { id, caller }: ReadId,
    query: QueryParams,
) -> Result<Response, ApiError> {
    let window = HistoryWindow {
        since_seq: query.integer("sinceSeq", 0, u64::MAX)?.unwrap_or(0),
        before_seq: query.integer("beforeSeq", 1, u64::MAX)?,
        limit: query.integer("limit", 1, u64::MAX)?,
        inflight: match query.get("include") {
            None => false,
            Some("inflight") => true,
            Some(other) => return Err(ApiError::bad(format!("`include` takes inflight, got {other:?}"))),
        },
    };
    // Another subject's conversation reads as an unknown one: empty. The one-page read checks
    // it in its own query (the hot path: no round trip more than a key's read); the paged read
    // asks first.
    let viewer = caller.viewer().map(|v| &**v);
    // Stored chunks pass through unparsed: the body is assembled around the pages' JSON.
    // Pages end at `--history-page-chunks` chunks or `--history-page-bytes` bytes, whichever
    // comes first: a reader that stalls holds a few pages, whatever the chunks' sizes.
    let (most, bytes) = (state.config.history_page_chunks, state.config.history_page_bytes as usize);
    if window.limit.is_some_and(|limit| limit <= most) {
        let page = state.store.history_within(&id, window, bytes, viewer).await?;
        // A window past the bytes of one page is read again in pages (rare: chunks of MiBs).
        if !page.cut {
            let mut body = [HistoryDocument::HEAD, &page.items].concat();
            body.extend(HistoryDocument { latest: page.last_seq.unwrap_or(window.since_seq) }.tail());
            return Ok(json(body));
        }
    }
    let document = HistoryDocument { latest: window.since_seq };
    if let Some(viewer) = viewer
        && let Ownership::Owned(owner) = state.store.ownership(&id).await?
        && owner.as_deref() != Some(viewer)
    {
        return Ok(json(format!(r#"{{"chunks":[],"latestSeq":{}}}"#, window.since_seq).into_bytes()));
    }
    paged(document, state.store.history_pages(id, window, most, bytes)).await
}

/// `{"chunks": [...], "latestSeq": n}`, `latestSeq` the last chunk's seq (or `sinceSeq`).
struct HistoryDocument {
    latest: u64,
}

impl Document for HistoryDocument {
    type Page = HistoryPage;
    const HEAD: &'static [u8] = br#"{"chunks":["#;

    fn items(&mut self, page: HistoryPage) -> Vec<u8> {
        self.latest = page.last_seq.unwrap_or(self.latest);
        page.items
    }

    fn tail(&self) -> Vec<u8> {
        let mut tail = br#"],"latestSeq":"#.to_vec();
        let _ = serde_json::to_writer(&mut tail, &self.latest);
        tail.push(b'}');
        tail
    }
}

/// `{"turns": [...]}`.
struct MetricsDocument;

impl Document for MetricsDocument {
    type Page = Vec<TurnMetrics>;
    const HEAD: &'static [u8] = br#"{"turns":["#;

    fn items(&mut self, turns: Vec<TurnMetrics>) -> Vec<u8> {
        let mut items = Vec::new();
        for (i, turn) in turns.iter().enumerate() {
            if i > 0 {
                items.push(b',');
            }
            serde_json::to_writer(&mut items, turn).expect("metrics serialize");
        }
        items
    }

    fn tail(&self) -> Vec<u8> {
        b"]}".to_vec()
    }
}

/// Metrics of every sealed turn, in turn order.
#[cfg_attr(feature = "openapi", utoipa::path(
    get,
    path = "/conversations/{id}/metrics",
    tag = "conversations",
    params(("id" = String, Path, description = "Conversation id")),
    responses((status = 200, body = MetricsResponse), (status = 400, body = ErrorBody), (status = 409, description = "The conversation was deleted while it was read", body = ErrorBody))
))]
pub async fn metrics(State(state): State<AppState>, seen: SeenId) -> Result<Response, ApiError> {
    if !seen.visible {
        return Ok(json(br#"{"turns":[]}"#.to_vec()));
    }
    let id = seen.id;
    // Pages end at `--metrics-page-turns` turns or `--history-page-bytes` bytes of their JSON.
    let pages = state.store.turn_metrics_pages(id, state.config.metrics_page_turns, state.config.history_page_bytes);
    paged(MetricsDocument, pages).await
}

/// Renames a conversation.
#[cfg_attr(feature = "openapi", utoipa::path(
    put,
    path = "/conversations/{id}/title",
    tag = "conversations",
    params(("id" = String, Path, description = "Conversation id")),
    request_body = TitleRequest,
    responses(
        (status = 200, body = TitleResponse),
        (status = 400, body = ErrorBody),
        (status = 404, description = "Unknown conversation", body = ErrorBody),
    )
))]
pub async fn set_title(
    State(state): State<AppState>,
    ConversationId(id): ConversationId,
    body: JsonObject,
) -> Result<Json<TitleResponse>, ApiError> {
    let title = title_field(&body, true)?.unwrap_or_default();
    if !state.store.set_title(&id, &title).await? {
        return Err(ApiError::NotFound(format!("no conversation {id:?}")));
    }
    Ok(Json(TitleResponse { conversation_id: id, title }))
}

/// Deletes a conversation with its log and metrics.
#[cfg_attr(feature = "openapi", utoipa::path(
    delete,
    path = "/conversations/{id}",
    tag = "conversations",
    params(("id" = String, Path, description = "Conversation id")),
    responses(
        (status = 204, description = "Deleted: its rows are gone and its id is free (it left every read when the deletion began)"),
        (status = 400, body = ErrorBody),
        (status = 404, description = "Unknown conversation, or one being deleted", body = ErrorBody),
        (status = 409, description = "A turn is running", body = ErrorBody),
    )
))]
pub async fn delete(State(state): State<AppState>, ConversationId(id): ConversationId) -> Result<StatusCode, ApiError> {
    match state.turns.delete(&id).await {
        Ok(true) => Ok(StatusCode::NO_CONTENT),
        Ok(false) => Err(ApiError::NotFound(format!("no conversation {id:?}"))),
        Err(StartError::Busy) => Err(ApiError::Conflict("a turn is running in this conversation".into())),
        Err(e) => Err(e.into()),
    }
}
