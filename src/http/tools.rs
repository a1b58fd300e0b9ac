//! `GET /tools`: the MCP servers, their state and the tools they give models (docs/tools.md).

use axum::Json;
use axum::extract::State;
use serde::Serialize;

use super::AppState;
use crate::tools::ServerView;

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ToolList {
    /// Each configured server: its state (`starting`, `ready`, `failed` with the reason,
    /// `stopped`; `idle` for a conversation server with no process) and its tools, named as
    /// models call them (`<server>__<tool>`).
    pub servers: Vec<ServerView>,
}

/// The MCP servers and their tools.
#[cfg_attr(feature = "openapi", utoipa::path(get, path = "/tools", tag = "models", responses((status = 200, body = ToolList))))]
pub async fn tools(State(state): State<AppState>) -> Json<ToolList> {
    Json(ToolList { servers: state.turns.registry().tools().view() })
}
