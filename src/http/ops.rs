//! `GET /ready`, `GET /metrics` and `GET /openapi.json`.

use axum::Json;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use super::AppState;
use super::error::ApiError;
#[cfg(feature = "openapi")]
use super::error::ErrorBody;
use super::extract::Caller;

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Ready {
    pub ready: bool,
}

/// Readiness: 200 while the database answers and turns are accepted; 503 while draining.
#[cfg_attr(feature = "openapi", utoipa::path(get, path = "/ready", tag = "operations", responses(
    (status = 200, body = Ready),
    (status = 503, description = "Shutting down, or the database does not answer", body = ErrorBody),
)))]
pub async fn ready(State(state): State<AppState>) -> Result<Response, ApiError> {
    if state.turns.is_closing() {
        // What a draining gateway is meant to say: not a failure worth an error line.
        let mut response = ApiError::Unavailable("shutting down".into()).into_response();
        response.extensions_mut().insert(super::error::Expected);
        return Ok(response);
    }
    if let Some(why) = state.store.current_write_fault().await {
        return Err(ApiError::Unavailable(format!("the database cannot take writes: {why}")));
    }
    if !state.store.ping().await {
        return Err(ApiError::Unavailable("the database does not answer".into()));
    }
    Ok(Json(Ready { ready: true }).into_response())
}

/// Prometheus text exposition of the gateway's counters.
#[cfg_attr(feature = "openapi", utoipa::path(get, path = "/metrics", tag = "operations", responses(
    (status = 200, description = "Prometheus text format", content_type = "text/plain; version=0.0.4", body = String),
    (status = 403, description = "Not an administrator: the counters are the whole gateway's", body = super::error::ErrorBody),
)))]
pub async fn metrics(State(state): State<AppState>, Caller(caller): Caller) -> Response {
    if !caller.admin {
        return ApiError::Forbidden(
            "the gateway's counters are for administrators (an API key, or a token with the dispatch:admin scope)"
                .into(),
        )
        .into_response();
    }
    let hub = &state.hub;
    let pacing = crate::metrics::Pacing {
        window: hub.window(),
        write_cost: hub.write_cost(),
        readers: hub.readers(),
        readers_elsewhere: hub.readers_elsewhere(),
    };
    let (running, connections) = (state.turns.running(), state.connections.open());
    let agents = state.turns.registry().processes();
    let mut body =
        state.metrics.render(running, hub.channel_count(), hub.buffered_bytes(), pacing, connections, &agents);
    state.turns.registry().tools().render_metrics(&mut body);
    ([(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], body).into_response()
}

/// The OpenAPI 3.1 document of this API.
#[cfg_attr(feature = "openapi", utoipa::path(get, path = "/openapi.json", tag = "operations",
    responses((status = 200, description = "This document", content_type = "application/json", body = Object))))]
pub async fn openapi_json() -> Response {
    ([(CONTENT_TYPE, "application/json")], super::OPENAPI_JSON).into_response()
}
