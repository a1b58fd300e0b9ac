//! The HTTP API: one module per resource, merged into one router.

mod chat;
mod console;
mod control;
mod conversations;
pub mod error;
mod events;
mod extract;
mod layers;
mod models;
mod openapi;
mod ops;
mod settings;
pub(crate) mod stream;
mod throughput;
pub mod ws;

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{Method, Uri};
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::Config;
use crate::hub::Hub;
use crate::store::Store;
use crate::turn::Turns;
use error::ApiError;

/// What every handler can reach. One `Arc`: axum clones the state several times per request
/// (each layer with state, each `State` extractor), so a clone is one reference count, not
/// one per field.
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

impl AppState {
    pub fn new(shared: Shared) -> AppState {
        AppState(Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The state's contents.
pub struct Shared {
    pub config: Arc<Config>,
    pub store: Store,
    pub hub: Arc<Hub>,
    pub turns: Arc<Turns>,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Cancelled at shutdown once every turn has sealed: live streams deliver what is left
    /// and end.
    pub drained: tokio_util::sync::CancellationToken,
    /// `/openapi.json`, serialized once.
    pub openapi: bytes::Bytes,
}

impl AppState {
    /// A place for one more live stream, or 503 when the cap is reached.
    pub fn stream_permit(
        &self,
        transport: crate::metrics::Transport,
    ) -> Result<crate::metrics::StreamPermit, ApiError> {
        crate::metrics::StreamPermit::acquire(&self.metrics, transport, self.config.max_streams)
            .ok_or_else(|| ApiError::Unavailable("too many open streams; try again later".into()))
    }

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
        (name = "console", description = "The web console's page and modules"),
    )
)]
struct ApiDoc;

/// Every documented route, not yet bound to a state.
fn api() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
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
        .routes(routes!(settings::get_model, settings::put_model))
        .routes(routes!(settings::get_cwd, settings::put_cwd))
        .routes(routes!(settings::get_reasoning_effort, settings::put_reasoning_effort))
        .routes(routes!(settings::lsp))
        .routes(routes!(throughput::throughput))
        .routes(routes!(ws::ws))
        .routes(routes!(openapi_json))
        .routes(routes!(ops::ready))
        .routes(routes!(ops::metrics))
        .routes(routes!(console::page))
        .routes(routes!(console::asset))
}

/// The OpenAPI document of the API, as pretty JSON (what `openapi/openapi.json` holds).
pub fn openapi_json_text() -> String {
    let (_, doc) = api().split_for_parts();
    let value = serde_json::to_value(&doc).expect("the OpenAPI document serializes");
    serde_json::to_string_pretty(&openapi::refine(value)).expect("JSON serializes") + "\n"
}

/// The OpenAPI 3.1 document of this API.
#[utoipa::path(get, path = "/openapi.json", tag = "operations",
    responses((status = 200, description = "This document", content_type = "application/json", body = Object)))]
async fn openapi_json(State(state): State<AppState>) -> axum::response::Response {
    use axum::response::IntoResponse;
    ([(axum::http::header::CONTENT_TYPE, "application/json")], state.openapi.clone()).into_response()
}

/// The routes bound to the gateway's state.
pub fn router(state: AppState) -> Router {
    let (router, _) = api().split_for_parts();
    let router = router.fallback(not_found).method_not_allowed_fallback(method_not_allowed);
    #[cfg(feature = "docs-ui")]
    let router = router.merge(docs_ui());
    layers::wrap(router, &state).with_state(state)
}

/// The router of the optional WebSocket-only listener: every path upgrades.
pub fn ws_router(state: AppState) -> Router {
    layers::wrap(Router::new().fallback(ws::ws), &state).with_state(state)
}

/// The Swagger UI page at `/docs`, from assets compiled into the binary (no CDN).
#[cfg(feature = "docs-ui")]
fn docs_ui() -> Router<AppState> {
    let doc: serde_json::Value = serde_json::from_str(&openapi_json_text()).expect("the document is JSON");
    utoipa_swagger_ui::SwaggerUi::new("/docs").external_url_unchecked("/docs/openapi.json", doc).into()
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::NotFound(format!("no route for {method} {}", uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> axum::response::Response {
    use axum::response::IntoResponse;
    let body = error::ErrorBody { error: format!("method {method} is not allowed on {}", uri.path()) };
    (axum::http::StatusCode::METHOD_NOT_ALLOWED, axum::Json(body)).into_response()
}
