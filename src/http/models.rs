//! `GET /models` and `GET /health`.

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::State;
use serde::Serialize;

use super::AppState;
use crate::runtime::ModelInfo;

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ModelList {
    /// `<credential>/<model>` names.
    pub models: Vec<String>,
    /// The gateway's: the model of a turn that names none in a conversation that has none.
    pub default_model: String,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub model_info: BTreeMap<String, ModelInfo>,
}

/// The models turns can run on.
#[cfg_attr(feature = "openapi", utoipa::path(get, path = "/models", tag = "models", responses((status = 200, body = ModelList))))]
pub async fn models(State(state): State<AppState>) -> Json<ModelList> {
    let registry = state.turns.registry();
    Json(ModelList {
        models: registry.names().map(str::to_owned).collect(),
        default_model: registry.default_model().to_owned(),
        model_info: registry
            .infos()
            .filter(|(_, info)| info.context_window.is_some() || !info.settings.is_empty())
            .map(|(name, info)| (name.to_owned(), info.clone()))
            .collect(),
    })
}

#[derive(Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    pub ok: bool,
}

/// Liveness: answers as long as the process serves requests.
#[cfg_attr(feature = "openapi", utoipa::path(get, path = "/health", tag = "operations", responses((status = 200, body = Health))))]
pub async fn health() -> Json<Health> {
    Json(Health { ok: true })
}
