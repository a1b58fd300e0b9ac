//! The HTTP API: one module per resource, merged into one router.

mod chat;
mod control;
mod conversations;
pub mod error;
mod events;
mod extract;
mod models;
mod stream;
mod throughput;
mod ws;

use std::sync::Arc;

use axum::Router;
use axum::http::{Method, Uri};
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::Config;
use crate::hub::Hub;
use crate::store::Store;
use crate::turn::Turns;
use error::ApiError;

/// What every handler can reach. Cheap to clone: everything is behind an `Arc` (axum clones
/// the state per request).
#[derive(Clone)]
pub struct AppState {
    pub config: Arc<Config>,
    pub store: Store,
    pub hub: Arc<Hub>,
    pub turns: Arc<Turns>,
    /// Cancelled at shutdown once every turn has sealed: live streams deliver what is left
    /// and end.
    pub drained: tokio_util::sync::CancellationToken,
}

impl AppState {
    /// The keep-alive period of live streams.
    pub fn keepalive(&self) -> Option<std::time::Duration> {
        (self.config.keepalive_secs > 0).then(|| std::time::Duration::from_secs(self.config.keepalive_secs))
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "dispatch-gateway", description = "Turns, an append-only log and live streams for agent runtimes."),
    components(schemas(crate::wire::AgentEvent, crate::wire::Chunk, crate::wire::StoredChunk)),
    tags(
        (name = "chat", description = "Start turns and stream them"),
        (name = "conversations", description = "Conversations, their log and metrics"),
        (name = "models", description = "Models turns can run on"),
        (name = "streams", description = "Live streams: SSE, NDJSON, WebSocket"),
        (name = "control", description = "Start, stop, steer and inspect turns"),
        (name = "operations", description = "Health and operations"),
    )
)]
struct ApiDoc;

/// The routes and the OpenAPI document they describe.
pub fn router_with_doc(state: AppState) -> (Router, utoipa::openapi::OpenApi) {
    let (router, doc) = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(models::health))
        .routes(routes!(models::models))
        .routes(routes!(chat::chat))
        .routes(routes!(conversations::create, conversations::list))
        .routes(routes!(conversations::history, conversations::delete))
        .routes(routes!(conversations::metrics))
        .routes(routes!(conversations::set_title))
        .routes(routes!(events::events))
        .routes(routes!(control::messages))
        .routes(routes!(control::stop))
        .routes(routes!(control::close))
        .routes(routes!(control::queue))
        .routes(routes!(control::status))
        .routes(routes!(control::last))
        .routes(routes!(control::get_model, control::put_model))
        .routes(routes!(throughput::throughput))
        .routes(routes!(ws::ws))
        .split_for_parts();
    let router = router.fallback(not_found).method_not_allowed_fallback(method_not_allowed).with_state(state);
    (router, doc)
}

pub fn router(state: AppState) -> Router {
    router_with_doc(state).0
}

/// The router of the optional WebSocket-only listener: every path upgrades.
pub fn ws_router(state: AppState) -> Router {
    Router::new().fallback(ws::ws).with_state(state)
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::NotFound(format!("no route for {method} {}", uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> axum::response::Response {
    use axum::response::IntoResponse;
    let body = error::ErrorBody { error: format!("method {method} is not allowed on {}", uri.path()) };
    (axum::http::StatusCode::METHOD_NOT_ALLOWED, axum::Json(body)).into_response()
}
