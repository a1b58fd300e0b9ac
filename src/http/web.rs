//! `--web-root`: a static web client served from the gateway's own origin at `--web-path`, so
//! that its pages sign in once (`POST /auth/session`, through the console's sign-in) and then
//! use the API with the session cookie alone. Files go out as they are, streamed from disk in
//! chunks (a reader that stalls holds one chunk and the connection's buffer, never the whole
//! file), with the console's security headers; a path that names no file gets `index.html` (a
//! client that routes in the page); a name that begins with `.` (`.env`, `.git`) is never
//! served. With auth on, a request that is not signed in is sent to the console's sign-in with
//! a way back (`/?next=/app/...`): a new user is told where to sign in, and the client's files
//! are for signed-in people only.

use std::path::{Component, Path, PathBuf};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, header};
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::error::ApiError;

/// The bytes of a file read at a time: what a stalled reader holds besides its connection's
/// buffer.
const CHUNK: usize = 64 * 1024;

#[derive(Clone)]
struct Root {
    root: PathBuf,
    /// `--web-path` without its last `/`: what the nesting took off the request's path.
    prefix: String,
    /// Auth is on: a request must be signed in.
    auth: bool,
}

/// The routes under `path` (which starts and ends with `/`).
pub(super) fn router(root: PathBuf, path: &str, auth: bool) -> Router<AppState> {
    let prefix = path.trim_end_matches('/');
    let files = Router::new().fallback(serve).with_state(Root { root, prefix: prefix.to_owned(), auth });
    Router::new().nest_service(prefix, files)
}

async fn serve(State(Root { root, prefix, auth }): State<Root>, req: Request) -> Response {
    if !matches!(*req.method(), Method::GET | Method::HEAD) {
        return ApiError::NotFound(format!("no route for {} {}", req.method(), req.uri().path())).into_response();
    }
    // The path is public to the authentication layer, which leaves the identity out (and
    // says why) when the request is not signed in.
    if auth && req.extensions().get::<crate::identity::Identity>().is_none() {
        return to_sign_in(&prefix, &req);
    }
    let asked = req.uri().path().trim_start_matches('/');
    let Some(relative) = file_path(asked) else {
        return ApiError::NotFound("no such file".into()).into_response();
    };
    let (file, name) = match open_inside(&root, &relative).await {
        Some(file) => (file, relative),
        None => match open_inside(&root, Path::new("index.html")).await {
            Some(file) => (file, PathBuf::from("index.html")),
            None => return ApiError::NotFound("the web root has no index.html".into()).into_response(),
        },
    };
    let (file, length) = file;
    let body = axum::body::Body::from_stream(tokio_util::io::ReaderStream::with_capacity(file, CHUNK));
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(media_type(&name)));
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    super::console::secure(headers);
    response
}

/// 303 to the console's sign-in, which comes back to the page asked for once signed in.
fn to_sign_in(prefix: &str, req: &Request) -> Response {
    let back = format!("{prefix}{}", req.uri().path_and_query().map_or("/", |p| p.as_str()));
    let next = percent_encoding::utf8_percent_encode(&back, percent_encoding::NON_ALPHANUMERIC);
    let mut response = axum::http::StatusCode::SEE_OTHER.into_response();
    let location = HeaderValue::from_str(&format!("/?next={next}")).unwrap_or(HeaderValue::from_static("/"));
    response.headers_mut().insert(header::LOCATION, location);
    super::console::secure(response.headers_mut());
    response
}

/// The path as a relative file path, or `None` when it climbs out (`..`), is not plain, or
/// names something hidden (a name beginning with `.`).
fn file_path(asked: &str) -> Option<PathBuf> {
    let decoded = percent_encoding::percent_decode_str(asked).decode_utf8().ok()?;
    if decoded.contains('\0') {
        return None;
    }
    let path = PathBuf::from(&*decoded);
    plain(&path).then_some(path)
}

/// Every component a plain name that does not begin with `.`.
fn plain(path: &Path) -> bool {
    path.components().all(|c| matches!(c, Component::Normal(name) if !name.as_encoded_bytes().starts_with(b".")))
}

/// A regular file open for reading, and its length, if `relative` names one inside `root` once
/// symlinks are followed (and what a link leads to is no hidden name either).
async fn open_inside(root: &Path, relative: &Path) -> Option<(tokio::fs::File, u64)> {
    if relative.as_os_str().is_empty() {
        return None;
    }
    let (root, relative) = (root.to_owned(), relative.to_owned());
    let file = tokio::task::spawn_blocking(move || {
        let root = std::fs::canonicalize(root).ok()?;
        let path = std::fs::canonicalize(root.join(relative)).ok()?;
        if !plain(path.strip_prefix(&root).ok()?) {
            return None;
        }
        let file = std::fs::File::open(&path).ok()?;
        let metadata = file.metadata().ok()?;
        metadata.is_file().then_some((file, metadata.len()))
    })
    .await
    .ok()
    .flatten()?;
    Some((tokio::fs::File::from_std(file.0), file.1))
}

fn media_type(name: &Path) -> &'static str {
    match name.extension().and_then(|e| e.to_str()).unwrap_or("") {
        "html" | "htm" => "text/html; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "json" | "map" => "application/json",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "gif" => "image/gif",
        "ico" => "image/x-icon",
        "webp" => "image/webp",
        "woff2" => "font/woff2",
        "woff" => "font/woff",
        "txt" => "text/plain; charset=utf-8",
        "wasm" => "application/wasm",
        _ => "application/octet-stream",
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn paths_stay_inside_the_root() {
        assert!(super::file_path("a/b.js").is_some());
        assert!(super::file_path("../etc/passwd").is_none());
        assert!(super::file_path("a/%2e%2e/%2e%2e/x").is_none());
        assert!(super::file_path("/abs").is_none());
        assert!(super::file_path("a%00b").is_none());
        assert!(super::file_path(".env").is_none());
        assert!(super::file_path("a/.git/config").is_none());
        assert!(super::file_path("%2eenv").is_none());
    }
}
