//! The web console at `/`: a page and its modules, compiled into the binary (no CDN, no build
//! step). The assets hold no data, so they are public like `/health`; the page asks for a key
//! when the API answers 401. What the console does is in `docs/console.md`.

use axum::extract::Path;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
#[cfg(feature = "openapi")]
use super::error::ErrorBody;

/// Where the console's modules are served from; public like `/` (see `layers::is_public`).
pub(super) const ASSETS: &str = "/console/";

/// The page: scripts and styles only from the gateway itself, never framed (also the policy of
/// a web client under `--web-root`).
pub(super) const POLICY: &str = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; \
                      connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

const JS: &str = "text/javascript; charset=utf-8";

/// Every asset by name, with its media type.
const FILES: &[(&str, &str, &str)] = &[
    ("app.js", JS, include_str!("../../console/app.js")),
    ("api.js", JS, include_str!("../../console/api.js")),
    ("dom.js", JS, include_str!("../../console/dom.js")),
    ("live.js", JS, include_str!("../../console/live.js")),
    ("list.js", JS, include_str!("../../console/list.js")),
    ("conversation.js", JS, include_str!("../../console/conversation.js")),
    ("transcript.js", JS, include_str!("../../console/transcript.js")),
    ("metrics.js", JS, include_str!("../../console/metrics.js")),
    ("plot.js", JS, include_str!("../../console/plot.js")),
    ("gateway.js", JS, include_str!("../../console/gateway.js")),
    ("style.css", "text/css; charset=utf-8", include_str!("../../console/style.css")),
];

fn serve(media_type: &'static str, body: &'static str) -> Response {
    let mut response = ([(header::CONTENT_TYPE, media_type)], body).into_response();
    secure(response.headers_mut());
    response
}

/// The headers every page the gateway serves carries.
pub(super) fn secure(headers: &mut axum::http::HeaderMap) {
    // Revalidated on every load, so a new gateway's console is never mixed with an old one's
    // cached modules.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(POLICY));
}

/// The web console: conversations live, a composer, metrics as plots, the gateway's own state.
#[cfg_attr(feature = "openapi", utoipa::path(get, path = "/", tag = "console",
    responses((status = 200, description = "The console's page", content_type = "text/html", body = String))))]
pub async fn page() -> Response {
    serve("text/html; charset=utf-8", include_str!("../../console/index.html"))
}

/// One of the console's modules or its style sheet.
#[cfg_attr(feature = "openapi", utoipa::path(get, path = "/console/{asset}", tag = "console",
    params(("asset" = String, Path, description = "A file name such as `app.js`")),
    responses(
        (status = 200, description = "The asset: a JavaScript module or the style sheet",
            content((String = "text/javascript"), (String = "text/css"))),
        (status = 404, description = "No such asset", body = ErrorBody),
    )))]
pub async fn asset(Path(name): Path<String>) -> Result<Response, ApiError> {
    let (_, media_type, body) = FILES
        .iter()
        .find(|(file, ..)| *file == name)
        .ok_or_else(|| ApiError::NotFound(format!("the console has no asset {name:?}")))?;
    Ok(serve(media_type, body))
}
