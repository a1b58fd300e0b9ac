//! What wraps every route: request ids and logs, CORS, API keys, timeouts.

use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::uri::Authority;
use axum::http::{HeaderName, HeaderValue, Method, Version, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use tower_http::cors::{AllowOrigin, CorsLayer};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tracing::Instrument;

use super::AppState;
use super::error::{ApiError, InternalDetail};

/// Routes anyone may call, keys or not.
const PUBLIC: &[&str] = &["/health", "/ready", "/openapi.json", "/"];

/// Whether anyone may call `path`, keys or not: the probes, the API's description, and the
/// console's page and modules (which hold no data: the page asks for a key when the API does).
pub(super) fn is_public(path: &str) -> bool {
    PUBLIC.contains(&path) || path.starts_with(super::console::ASSETS)
}

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Wraps the router, outermost first: request id, log line (and span), the Host check, CORS (so
/// preflights are answered before auth), API keys, timeouts.
pub fn wrap(router: Router<AppState>, state: &AppState) -> Router<AppState> {
    router
        .layer(middleware::from_fn_with_state(state.clone(), timeout))
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .layer(cors(&state.config.cors_origins))
        .layer(middleware::from_fn(one_host))
        .layer(PropagateRequestIdLayer::new(REQUEST_ID))
        .layer(middleware::from_fn_with_state(state.clone(), trace))
        .layer(SetRequestIdLayer::new(REQUEST_ID, MakeRequestUuid))
}

/// Counts each response by status, and logs one line per failed request (5xx), with its id,
/// method, path, status, latency and, for a 500, what went wrong. With debug logs on, the
/// request also runs in a span with its id, and its start and end are logged. The span is
/// debug-level: a span per request (created with its fields formatted, entered, closed) is a
/// large share of the CPU a short request takes. The body is not wrapped: a live stream's body
/// is polled for every batch it writes.
async fn trace(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let id = req.headers().get(&REQUEST_ID).cloned();
    let id = id.as_ref().and_then(|v| v.to_str().ok()).unwrap_or("-");
    let (method, uri) = (req.method().clone(), req.uri().clone());
    let span = tracing::debug_span!("request", id, method = %method, path = uri.path());
    let started = std::time::Instant::now();
    let response = async move {
        tracing::debug!("started processing request");
        next.run(req).await
    }
    .instrument(span.clone())
    .await;
    let latency_ms = started.elapsed().as_secs_f64() * 1000.0;
    state.metrics.responded(response.status());
    let status = response.status().as_u16();
    if response.status().is_server_error() && response.extensions().get::<super::error::Expected>().is_some() {
        tracing::info!(id, method = %method, path = uri.path(), status, latency_ms, "answered while draining");
    } else if response.status().is_server_error() {
        let error = response.extensions().get::<InternalDetail>().map_or("", |d| d.0.as_str());
        tracing::error!(id, method = %method, path = uri.path(), status, latency_ms, error, "request failed");
    } else {
        span.in_scope(|| tracing::debug!(status, latency_ms, "finished processing request"));
    }
    response
}

/// An HTTP/1.1 request names one host, and any request at most one, as `host[:port]` (RFC 9112
/// 3.2): the WebSocket origin check reads it, and with two a proxy in front may have read the
/// other. HTTP/2 names it in the request's URI instead.
async fn one_host(req: Request, next: Next) -> Response {
    let mut hosts = req.headers().get_all(header::HOST).iter();
    let valid = match (hosts.next(), hosts.next()) {
        (None, _) => req.version() != Version::HTTP_11,
        (Some(host), None) => host.is_empty() || is_host(host.as_bytes()),
        (Some(_), Some(_)) => false,
    };
    if !valid {
        return ApiError::bad("the request must name its host in one Host header, as host[:port]").into_response();
    }
    next.run(req).await
}

/// `host[:port]`: an authority without user information, its port digits.
fn is_host(value: &[u8]) -> bool {
    let Some(authority) = Authority::try_from(value).ok().filter(|_| !value.contains(&b'@')) else {
        return false;
    };
    let port = &authority.as_str()[authority.host().len()..];
    port.is_empty() || port.strip_prefix(':').is_some_and(|p| p.bytes().all(|b| b.is_ascii_digit()))
}

fn cors(origins: &[String]) -> CorsLayer {
    let allow_origin = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
    };
    CorsLayer::new()
        .allow_origin(allow_origin)
        .allow_methods([Method::GET, Method::POST, Method::PUT, Method::DELETE, Method::OPTIONS])
        .allow_headers([
            header::CONTENT_TYPE,
            header::AUTHORIZATION,
            HeaderName::from_static("last-event-id"),
            HeaderName::from_static("idempotency-key"),
        ])
        // Retry-After is not one a page may read unless named (the 503s of a cap carry it).
        .expose_headers([HeaderName::from_static("x-conversation-id"), REQUEST_ID, header::RETRY_AFTER])
        .max_age(Duration::from_secs(600))
}

/// Whether `presented` is one of `keys`, in a time that depends on neither where the inputs
/// differ nor their lengths: both sides are hashed to 32 bytes, then compared in constant time,
/// against every key (no early exit at a match).
fn key_matches(keys: &[String], presented: &[u8]) -> bool {
    use ring::digest::{SHA256, digest};
    use subtle::ConstantTimeEq;
    let presented = digest(&SHA256, presented);
    let mut found = subtle::Choice::from(0);
    for key in keys {
        found |= digest(&SHA256, key.as_bytes()).as_ref().ct_eq(presented.as_ref());
    }
    bool::from(found)
}

/// The key a request presents: `Authorization: Bearer <key>`, else `?access_token=<key>` (for
/// EventSource and WebSocket clients, which cannot set headers).
fn presented_key(req: &Request) -> Option<String> {
    if let Some(value) = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        let (scheme, key) = value.split_once(' ')?;
        return scheme.eq_ignore_ascii_case("bearer").then(|| key.trim().to_owned());
    }
    form_urlencoded::parse(req.uri().query()?.as_bytes())
        .find(|(k, _)| k == "access_token")
        .map(|(_, v)| v.into_owned())
}

async fn authenticate(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let keys = &state.config.api_keys;
    // A public path is public as the plain route it names: an upgrade of it is a WebSocket
    // session (on `--ws-listen` every path upgrades), and needs a key like any other.
    let public = is_public(req.uri().path()) && !req.headers().contains_key(header::UPGRADE);
    if keys.is_empty() || public {
        return next.run(req).await;
    }
    // No key is never a key (an empty one is refused at start too).
    let valid = presented_key(&req).is_some_and(|key| !key.is_empty() && key_matches(keys, key.as_bytes()));
    if valid {
        return next.run(req).await;
    }
    let mut response = ApiError::Unauthorized.into_response();
    response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// Whether reading a body failed because it passed the size limit.
fn is_length_limit(error: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if e.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = e.source();
    }
    false
}

/// Streaming routes run as long as their stream; `/last` has its own bound.
fn is_streaming(path: &str) -> bool {
    path == "/chat" || path == "/ws" || path.ends_with("/events") || path.ends_with("/last")
}

async fn timeout(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let limit = Duration::from_secs(state.config.request_timeout_secs.max(1));
    if is_streaming(req.uri().path()) || req.headers().contains_key(header::UPGRADE) {
        // The streamed response is exempt from the timeout; the request's body is not: it is
        // read whole (within the body limit) before the handler runs.
        let (parts, body) = req.into_parts();
        let max = state.config.max_body_bytes;
        let bytes = match tokio::time::timeout(limit, axum::body::to_bytes(body, max)).await {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(e)) if is_length_limit(&e) => return ApiError::TooLarge(max).into_response(),
            Ok(Err(_)) => return ApiError::bad("the request body could not be read").into_response(),
            Err(_) => return ApiError::SlowBody("the request body did not arrive in time".into()).into_response(),
        };
        return next.run(Request::from_parts(parts, axum::body::Body::from(bytes))).await;
    }
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(response) => response,
        Err(_) => ApiError::Unavailable("the request timed out".into()).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::{is_host, key_matches};

    #[test]
    fn a_host_is_a_name_or_address_and_a_port() {
        for good in
            ["gateway", "gateway:8080", "127.0.0.1:1", "[::1]:8080", "[::1]", "xn--bcher-kva.example", "gateway:"]
        {
            assert!(is_host(good.as_bytes()), "{good}");
        }
        for bad in ["a b", "user@gateway", "gateway/path", "gateway:port", "gateway?q", "[::1", "[::1]x"] {
            assert!(!is_host(bad.as_bytes()), "{bad}");
        }
    }

    #[test]
    fn keys_compare_exactly() {
        let keys = ["secret".to_owned(), "other".to_owned()];
        assert!(key_matches(&keys, b"secret"));
        assert!(key_matches(&keys, b"other"));
        assert!(!key_matches(&keys, b"secreT"));
        assert!(!key_matches(&keys, b"secret2"));
        assert!(!key_matches(&keys, b""));
        assert!(!key_matches(&[], b"secret"));
    }
}
