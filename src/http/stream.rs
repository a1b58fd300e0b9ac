//! The response that opens an SSE or NDJSON watch: its head, with the watch handed to the
//! connection (`live::Handoff`), which writes it as the body.

use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;

use super::AppState;
use crate::encoding::Transport;
use crate::hub::Cursor;
use crate::live::{Handoff, Live, Watch, WatchSetup, content_type};
use crate::metrics::StreamPermit;

/// A watcher of `cursor` with the gateway's keep-alive, store and shutdown.
pub fn watch(
    state: &AppState,
    cursor: Cursor,
    format: Transport,
    conversation_id: String,
    until_sealed: bool,
    resync_first: bool,
    permit: StreamPermit,
) -> Watch {
    Watch::new(WatchSetup {
        cursor,
        format,
        until_sealed,
        resync_first,
        keepalive: state.keepalive(),
        store: state.store.clone(),
        conversation_id,
        // The caller's credential taken back ends it too (see `Watch::next`).
        drained: permit.end_token(&state.drained).clone(),
        metrics: state.metrics.clone(),
        permit,
    })
}

/// The watcher of a conversation the caller may not see, watched as an id nobody has used:
/// nothing ever comes, and a resume cursor (`resync_first`) answers `resync` at `latestSeq` 0,
/// as it does for an unused id.
pub fn blind_watch(state: &AppState, format: Transport, id: String, resync_first: bool, permit: StreamPermit) -> Watch {
    let mut watch = watch(state, Cursor::idle(), format, id, false, resync_first, permit);
    watch.blind();
    watch
}

/// The `200` of a watcher, with the headers every live stream carries.
pub fn watch_response(watch: Watch) -> Response {
    // A body of no known length (none is written: the watch is the body), so that nothing on
    // the way out gives the response a `content-length`.
    let unsized_body = futures_util::stream::empty::<Result<bytes::Bytes, std::convert::Infallible>>();
    let mut response = Response::new(axum::body::Body::from_stream(unsized_body));
    *response.status_mut() = StatusCode::OK;
    let h = response.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(content_type(watch.format)));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Handoff::attach(&mut response, Live::Watch(watch));
    response
}
