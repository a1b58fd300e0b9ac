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
use crate::identity::{AuthError, Identity};

/// Routes anyone may call, keys or not.
const PUBLIC: &[&str] = &["/health", "/ready", "/openapi.json", "/", "/auth/session"];

/// Whether anyone may call `path`, keys or not: the probes, the API's description, signing in,
/// the console's page and modules, and a `--web-root` client's files (which send a request
/// that is not signed in to the console's sign-in themselves, rather than answer 401).
pub(super) fn is_public(config: &crate::config::Config, path: &str) -> bool {
    PUBLIC.contains(&path)
        || path.starts_with(super::console::ASSETS)
        || config.web_root.is_some() && path.starts_with(&config.web_path)
}

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Wraps the router, outermost first: request id, log line (and span), the guard (host, origin,
/// body type), CORS (so preflights are answered before auth), API keys, the reading budget,
/// timeouts. Everything up to the budget looks at the request's head only: no byte of a body is
/// read for a request that is refused.
pub fn wrap(router: Router<AppState>, state: &AppState) -> Router<AppState> {
    router
        .layer(middleware::from_fn_with_state(state.clone(), timeout))
        .layer(middleware::from_fn_with_state(state.clone(), budget))
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .layer(cors(&state.config))
        .layer(middleware::from_fn_with_state(state.clone(), guard))
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

/// What a request must be before anything else looks at it (docs/security.md), from its head alone:
/// - It names one host, as `host[:port]` (RFC 9112 3.2; with two, a proxy in front may have
///   read the other), and one this gateway answers to (421 otherwise): a page whose name was
///   re-bound to this machine's address names its own host, so it reads nothing (DNS
///   rebinding).
/// - A state change (POST, PUT, PATCH, DELETE) or a WebSocket handshake from a browser page
///   comes from an allowed origin or the gateway's own (403 otherwise): browsers send simple
///   requests across origins without asking first.
/// - A body is typed as JSON (415 otherwise): a form or a `no-cors` fetch cannot send that type
///   without a preflight, which CORS answers only for allowed origins.
async fn guard(State(state): State<AppState>, req: Request, next: Next) -> Response {
    match admit(&state.config, &req) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

fn admit(config: &crate::config::Config, req: &Request) -> Result<(), ApiError> {
    let headers = req.headers();
    let mut hosts = headers.get_all(header::HOST).iter();
    let host = match (hosts.next(), hosts.next()) {
        (None, _) if req.version() != Version::HTTP_11 => req.uri().authority().map(|a| a.as_str().as_bytes()),
        (Some(host), None) if host.is_empty() || is_host(host.as_bytes()) => Some(host.as_bytes()),
        _ => return Err(ApiError::bad("the request must name its host in one Host header, as host[:port]")),
    };
    if let Some(host) = host.filter(|h| !h.is_empty())
        && !config.allows_host(host)
    {
        return Err(ApiError::MisdirectedHost(
            "this gateway does not answer to that host name (--allowed-hosts)".into(),
        ));
    }
    let changes = matches!(*req.method(), Method::POST | Method::PUT | Method::PATCH | Method::DELETE);
    let handshake = headers.contains_key(header::UPGRADE);
    if (changes || handshake)
        && let Some(origin) = headers.get(header::ORIGIN)
        && !config.admits_origin(origin.as_bytes(), host)
    {
        return Err(ApiError::Forbidden("this page's origin is not allowed here (--cors-origins)".into()));
    }
    if changes && has_body(headers) && !is_json(headers.get(header::CONTENT_TYPE)) {
        return Err(ApiError::UnsupportedType(
            "a request body must be JSON, sent as Content-Type: application/json".into(),
        ));
    }
    Ok(())
}

/// Whether a request has a body: a length above zero, or a transfer coding.
fn has_body(headers: &axum::http::HeaderMap) -> bool {
    headers.contains_key(header::TRANSFER_ENCODING)
        || headers.get(header::CONTENT_LENGTH).is_some_and(|v| v.as_bytes().iter().any(|b| *b != b'0'))
}

/// `application/json`, or any `+json` type, with or without parameters (a charset).
fn is_json(value: Option<&HeaderValue>) -> bool {
    let Some(value) = value.and_then(|v| v.to_str().ok()) else { return false };
    // Compared in place (no lowercased copy): it runs on every request with a body.
    let essence = value.split(';').next().unwrap_or("").trim();
    let Some((kind, subtype)) = essence.split_once('/') else { return false };
    let json = |s: &str| s.eq_ignore_ascii_case("json");
    kind.eq_ignore_ascii_case("application")
        && (json(subtype)
            || subtype.len() > 5
                && json(&subtype[subtype.len() - 4..])
                && subtype.as_bytes()[subtype.len() - 5] == b'+')
}

/// Takes room in the reading budget (`--max-reading-bytes`) for the body a request declares,
/// held until the body is read or dropped: the bodies the gateway reads at once, over every
/// connection, stay within it (503 with Retry-After past it). A chunked body, whose length is
/// not known, takes the body limit.
async fn budget(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if !has_body(req.headers()) {
        return next.run(req).await;
    }
    let max = state.config.max_body_bytes;
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    let Some(permit) = state.reading.try_take(declared.unwrap_or(max).min(max)) else {
        let message = "the gateway is reading as many request bodies as it may at once; try again shortly";
        return ApiError::AtCapacity(message.into()).into_response();
    };
    let (parts, body) = req.into_parts();
    let body = axum::body::Body::new(crate::live::Budgeted::new(body, permit));
    next.run(Request::from_parts(parts, body)).await
}

/// `host[:port]`: an authority without user information, its port digits.
fn is_host(value: &[u8]) -> bool {
    let Some(authority) = Authority::try_from(value).ok().filter(|_| !value.contains(&b'@')) else {
        return false;
    };
    let port = &authority.as_str()[authority.host().len()..];
    port.is_empty() || port.strip_prefix(':').is_some_and(|p| p.bytes().all(|b| b.is_ascii_digit()))
}

fn cors(config: &std::sync::Arc<crate::config::Config>) -> CorsLayer {
    let allow_origin = if config.any_origin() {
        AllowOrigin::any()
    } else {
        // Entries may name any port of a host (`http://localhost:*`).
        let config = config.clone();
        AllowOrigin::predicate(move |origin, _| config.allows_origin(origin.as_bytes()))
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

/// Where a request's credential came from.
enum Presented<'a> {
    /// `Authorization: Bearer`, or `?access_token=` (EventSource and WebSocket clients, which
    /// cannot set headers).
    Token(std::borrow::Cow<'a, str>),
    /// The session cookie (`POST /auth/session`).
    Cookie(&'a str),
    /// An `Authorization` header of another scheme.
    Other,
}

/// The request's credential: the header first, then `?access_token=`, then the cookie.
fn presented(req: &Request) -> Option<Presented<'_>> {
    if let Some(value) = req.headers().get(header::AUTHORIZATION) {
        let value = value.to_str().ok();
        return Some(match value.and_then(|v| v.split_once(' ')) {
            Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => Presented::Token(token.trim().into()),
            _ => Presented::Other,
        });
    }
    if let Some(token) = req
        .uri()
        .query()
        .and_then(|q| form_urlencoded::parse(q.as_bytes()).find(|(k, _)| k == "access_token").map(|(_, v)| v))
    {
        return Some(Presented::Token(token));
    }
    super::auth::session_cookie(req.headers()).map(Presented::Cookie)
}

/// Who the request comes from (docs/identity.md): the identity goes into the request's extensions for
/// the handlers. A public path is served without a credential (and with one, as its subject).
/// A request authenticated by the session cookie alone must come from an allowed page to
/// change anything (its `Origin` present and admitted): the cookie goes along with requests a
/// browser makes for any page, which is what cross-site request forgery uses. Every state
/// change is logged with its subject (`dispatch::audit`).
async fn authenticate(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let auth = &state.auth;
    if !auth.enabled() {
        req.extensions_mut().insert(Identity::anonymous());
        return next.run(req).await;
    }
    // A public path is public as the plain route it names: an upgrade of it is a WebSocket
    // session (on `--ws-listen` every path upgrades), and needs a credential like any other.
    let public = is_public(&state.config, req.uri().path()) && !req.headers().contains_key(header::UPGRADE);
    let found = match presented(&req) {
        Some(Presented::Token(token)) => auth.identify(&token).await.map(|identity| (identity, false)),
        Some(Presented::Cookie(id)) => match auth.session(&crate::identity::session_hash(id)).await {
            Ok(Some(identity)) => Ok((identity, true)),
            Ok(None) => Err(AuthError::Invalid("the session has ended; sign in again".into())),
            // The database cannot say: a public route (a probe) is served anyway, others fail
            // as a read would (never "sign in again" for a session that may be fine).
            Err(_) if public => return next.run(req).await,
            Err(e) => return ApiError::from(e).into_response(),
        },
        Some(Presented::Other) => Err(AuthError::Invalid("the Authorization scheme must be Bearer".into())),
        None => Err(AuthError::Missing),
    };
    let (identity, by_cookie) = match found {
        Ok(found) => found,
        Err(e) if public => {
            // The route decides (`GET /auth/session` says why it knows nobody).
            req.extensions_mut().insert(std::sync::Arc::new(e));
            return next.run(req).await;
        }
        Err(e) => return super::error::refusal(&e),
    };
    let changes = matches!(*req.method(), Method::POST | Method::PUT | Method::PATCH | Method::DELETE);
    if by_cookie && (changes || req.headers().contains_key(header::UPGRADE)) {
        let host = req.headers().get(header::HOST).map(|h| h.as_bytes());
        let origin = req.headers().get(header::ORIGIN).map(|o| o.as_bytes());
        if !origin.is_some_and(|origin| state.config.admits_session_origin(origin, host)) {
            let message = "a request signed in by the session cookie alone must come from the gateway's own pages (Origin; --session-origins)";
            return ApiError::Forbidden(message.into()).into_response();
        }
    }
    if !changes {
        req.extensions_mut().insert(identity);
        return next.run(req).await;
    }
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    let subject = identity.subject.clone();
    let admin = identity.admin;
    req.extensions_mut().insert(identity);
    let response = next.run(req).await;
    tracing::info!(
        target: "dispatch::audit",
        subject = %crate::log_text::Escaped(&subject),
        admin,
        method = %method,
        path = %path,
        status = response.status().as_u16(),
        "state change"
    );
    response
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
            Ok(Err(e)) => return super::extract::body_error(e, max).into_response(),
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
    use super::{is_host, is_json};

    #[test]
    fn a_json_body_is_typed_as_json() {
        let typed = |v: &str| is_json(Some(&axum::http::HeaderValue::from_str(v).unwrap()));
        for good in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
            "application/merge-patch+json",
            "APPLICATION/LD+JSON",
        ] {
            assert!(typed(good), "{good}");
        }
        for bad in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "json",
            "",
            "application/jsonp",
            "application/xjson",
            "application/+json",
            "text/json",
        ] {
            assert!(!typed(bad), "{bad}");
        }
        assert!(!is_json(None));
    }

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
}
