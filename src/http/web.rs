//! `--web-root`: a static web client served from the gateway's own origin at `--web-path`
//! (spec 8.5), so that its pages sign in once (`POST /auth/session`) and then use the API with
//! the session cookie alone. Files go out as they are, with the console's security headers; a
//! path that names no file gets `index.html` (a client that routes in the page). Public, like
//! the console: the files hold no data.

use std::path::{Component, Path, PathBuf};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, header};
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::error::ApiError;

#[derive(Clone)]
struct Root(PathBuf);

/// The routes under `path` (which starts and ends with `/`).
pub(super) fn router(root: PathBuf, path: &str) -> Router<AppState> {
    let prefix = path.trim_end_matches('/');
    let files = Router::new().fallback(serve).with_state(Root(root));
    Router::new().nest_service(prefix, files)
}

async fn serve(State(Root(root)): State<Root>, req: Request) -> Response {
    if !matches!(*req.method(), Method::GET | Method::HEAD) {
        return ApiError::NotFound(format!("no route for {} {}", req.method(), req.uri().path())).into_response();
    }
    let asked = req.uri().path().trim_start_matches('/');
    let Some(relative) = file_path(asked) else {
        return ApiError::NotFound("no such file".into()).into_response();
    };
    let (body, name) = match read_inside(&root, &relative).await {
        Some(bytes) => (bytes, relative),
        None => match read_inside(&root, Path::new("index.html")).await {
            Some(bytes) => (bytes, PathBuf::from("index.html")),
            None => return ApiError::NotFound("the web root has no index.html".into()).into_response(),
        },
    };
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(media_type(&name)));
    super::console::secure(headers);
    response
}

/// The path as a relative file path, or `None` when it climbs out (`..`) or is not plain.
fn file_path(asked: &str) -> Option<PathBuf> {
    let decoded = percent_encoding::percent_decode_str(asked).decode_utf8().ok()?;
    if decoded.contains('\0') {
        return None;
    }
    let path = PathBuf::from(&*decoded);
    path.components().all(|c| matches!(c, Component::Normal(_))).then_some(path)
}

/// A regular file's bytes, if `relative` names one inside `root` once symlinks are followed.
async fn read_inside(root: &Path, relative: &Path) -> Option<Vec<u8>> {
    if relative.as_os_str().is_empty() {
        return None;
    }
    let (root, relative) = (root.to_owned(), relative.to_owned());
    tokio::task::spawn_blocking(move || {
        let root = std::fs::canonicalize(root).ok()?;
        let file = std::fs::canonicalize(root.join(relative)).ok()?;
        if !file.starts_with(&root) || !std::fs::metadata(&file).ok()?.is_file() {
            return None;
        }
        std::fs::read(&file).ok()
    })
    .await
    .ok()
    .flatten()
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
    }
}
