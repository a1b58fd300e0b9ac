//! The HTTP API: one module per resource, merged into one router.

mod auth;
mod chat;
mod console;
mod control;
mod conversations;
pub mod error;
mod events;
mod extract;
mod keys;
mod layers;
mod models;
#[cfg(feature = "openapi")]
mod openapi;
mod ops;
mod paged;
mod series;
mod settings;
pub(crate) mod stream;
mod throughput;
mod tools;
mod web;
pub mod ws;

use std::sync::Arc;

use axum::Router;
use axum::http::{Method, Uri};

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
    /// Bytes of request bodies and WebSocket messages being read (`--max-reading-bytes`).
    pub reading: crate::live::ReadingBudget,
    /// The listeners' places for connections (`--max-connections`).
    pub connections: crate::net::ConnectionSlots,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Checks keys and tokens.
    pub auth: Arc<crate::identity::Authenticator>,
    /// Each subject's open streams, against the `streams` quota.
    pub stream_quota: Arc<crate::identity::StreamQuota>,
    /// Cancelled at shutdown once every turn has sealed: live streams deliver what is left
    /// and end.
    pub drained: tokio_util::sync::CancellationToken,
}

impl AppState {
    /// A place for one more live stream of `caller`: 503 when the gateway's cap is reached,
    /// 429 past the caller's `streams` quota.
    pub async fn open_stream(
        &self,
        holder: crate::metrics::Holder,
        caller: &crate::identity::Identity,
    ) -> Result<crate::metrics::StreamPermit, ApiError> {
        let permit = crate::metrics::StreamPermit::acquire(&self.metrics, holder, self.config.max_streams)
            .ok_or_else(|| ApiError::AtCapacity("too many open streams; try again later".into()))?;
        // A signed-in caller's stream ends when its credential is taken back.
        let (permit, grant) = match self.auth.grants.hold(caller, &self.drained) {
            Some((ending, held)) => (permit.ending(ending), Some(held)),
            None => (permit, None),
        };
        let place = match caller.viewer() {
            Some(subject) => self.stream_quota.take(subject, caller.quotas(&self.config.quotas).streams).await?,
            None => None,
        };
        Ok(match (place, grant) {
            (None, None) => permit,
            (place, grant) => permit.holding((place, grant)),
        })
    }

    /// The keep-alive period of live streams.
    pub fn keepalive(&self) -> Option<std::time::Duration> {
        (self.config.keepalive_secs > 0).then(|| std::time::Duration::from_secs(self.config.keepalive_secs))
    }
}

/// Before a user watches conversation `id`: when nobody has used it, it becomes theirs (a
/// conversation row with no turn), so that nobody else can start a turn there and have it
/// streamed to them. False when it is (by now) another subject's. Administrators claim nothing.
pub(crate) async fn claim(state: &AppState, id: &str, caller: &crate::identity::Identity) -> Result<bool, ApiError> {
    let Some(viewer) = caller.viewer() else { return Ok(true) };
    if state.store.ownership(id).await? == crate::store::Ownership::Unused {
        let new = crate::store::NewConversation {
            id,
            title: "",
            model: None,
            owner: Some(viewer),
            now: crate::store::now_ms(),
        };
        match state.store.create_conversation(new).await {
            Ok(_) => {
                state.turns.created(id);
                return Ok(true);
            }
            Err(crate::store::StoreError::Exists | crate::store::StoreError::Deleting) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(matches!(state.store.ownership(id).await?, crate::store::Ownership::Owned(Some(owner)) if *owner == **viewer))
}

/// Every route of the API, once: each path with its methods' handlers. It builds the router;
/// in the `openapi` build it also lists the handlers whose annotations make the document
/// (`openapi.rs` checks that the document has exactly these routes).
macro_rules! api {
    ($($path:literal => { $($method:ident: $module:ident :: $handler:ident),+ $(,)? }),+ $(,)?) => {
        /// Every documented route, not yet bound to a state.
        fn api() -> Router<AppState> {
            Router::new()$(.route($path, axum::routing::MethodRouter::new()$(.$method($module::$handler))+))+
        }

        /// The routes as (method, path), for the document's check.
        #[cfg(all(test, feature = "openapi"))]
        const ROUTES: &[(&str, &str)] = &[$($((stringify!($method), $path)),+),+];

        #[cfg(feature = "openapi")]
        #[derive(utoipa::OpenApi)]
        #[openapi(
            info(title = "dispatch-gateway", description = "Turns, an append-only log and live streams for agent runtimes."),
            paths($($($module::$handler),+),+),
            components(schemas(crate::wire::AgentEvent, crate::wire::Chunk, crate::wire::StoredChunk, error::QuotaBody)),
            tags(
                (name = "chat", description = "Start turns and stream them"),
                (name = "conversations", description = "Conversations, their log and metrics"),
                (name = "models", description = "Models turns can run on, and the tools they get"),
                (name = "streams", description = "Live streams: SSE, NDJSON, WebSocket"),
                (name = "control", description = "Start, stop, steer and inspect turns"),
                (name = "operations", description = "Health and operations"),
                (name = "console", description = "The web console's page and modules"),
                (name = "auth", description = "Browser sessions (sign in with a token or key, get the session cookie), keys made at runtime, taking credentials back"),
            )
        )]
        struct ApiDoc;
    };
}

api! {
    "/health" => { get: models::health },
    "/models" => { get: models::models },
    "/tools" => { get: tools::tools },
    "/chat" => { post: chat::chat },
    "/conversations" => { post: conversations::create, get: conversations::list },
    "/conversations/{id}" => { get: conversations::history, delete: conversations::delete },
    "/conversations/{id}/metrics" => { get: conversations::metrics },
    "/conversations/{id}/title" => { put: conversations::set_title },
    "/conversations/{id}/events" => { get: events::events },
    "/conversations/{id}/messages" => { post: control::messages },
    "/conversations/{id}/stop" => { post: control::stop },
    "/conversations/{id}/close" => { post: control::close },
    "/conversations/{id}/queue" => { post: control::queue },
    "/conversations/{id}/status" => { get: control::status },
    "/conversations/{id}/last" => { get: control::last },
    "/conversations/{id}/model" => { get: settings::get_model, put: settings::put_model },
    "/conversations/{id}/cwd" => { get: settings::get_cwd, put: settings::put_cwd },
    "/conversations/{id}/reasoning-effort" => {
        get: settings::get_reasoning_effort,
        put: settings::put_reasoning_effort,
    },
    "/conversations/{id}/session" => { delete: settings::forget_session },
    "/conversations/{id}/lsp" => { get: settings::lsp },
    "/metrics/throughput" => { get: throughput::throughput },
    "/metrics/series" => { get: series::series },
    "/metrics/errors" => { get: series::errors },
    "/ws" => { get: ws::ws },
    "/auth/session" => { get: auth::get_session, post: auth::begin_session, delete: auth::end_session },
    "/auth/sessions" => { delete: keys::end_sessions },
    "/keys" => { post: keys::create, get: keys::list },
    "/keys/{id}" => { delete: keys::revoke },
    "/openapi.json" => { get: ops::openapi_json },
    "/ready" => { get: ops::ready },
    "/metrics" => { get: ops::metrics },
    "/" => { get: console::page },
    "/console/{asset}" => { get: console::asset },
}

/// The OpenAPI document served at `/openapi.json`: `openapi/openapi.json`, compiled in. The
/// `openapi` build generates it from the handlers' annotations (`--print-openapi`); a test of
/// that build checks the file is what it generates.
pub const OPENAPI_JSON: &str = include_str!("../../openapi/openapi.json");

/// The OpenAPI document generated from the handlers' annotations, as pretty JSON (what
/// `openapi/openapi.json` holds).
#[cfg(feature = "openapi")]
pub fn generated_openapi_json() -> String {
    use utoipa::OpenApi;
    let value = serde_json::to_value(ApiDoc::openapi()).expect("the OpenAPI document serializes");
    serde_json::to_string_pretty(&openapi::refine(value)).expect("JSON serializes") + "\n"
}

/// The routes bound to the gateway's state.
pub fn router(state: AppState) -> Router {
    let router = api().fallback(not_found).method_not_allowed_fallback(method_not_allowed);
    let router = match &state.config.web_root {
        Some(root) => router.merge(web::router(root.clone(), &state.config.web_path, state.auth.enabled())),
        None => router,
    };
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
    let doc: serde_json::Value = serde_json::from_str(OPENAPI_JSON).expect("the document is JSON");
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
