//! Turning a hub cursor into a streaming response body: batches of pre-framed bytes (one chunk
//! a batch), keep-alives, and `resync` when a watcher's position cannot be refilled.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use futures_util::Stream;
use tokio::time::{Instant, Interval, MissedTickBehavior};

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use crate::hub::{Cursor, Delivery, Frame, join_frames};
use crate::metrics::{Metrics, StreamPermit, Transport};
use crate::store::Store;

/// Most frames joined into one write: enough to make a write carry many events under load,
/// few enough (tens of KiB) that a lagging connection holds little beside the shared buffer.
const BATCH: usize = 128;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    Ndjson,
    Sse,
}

impl Framing {
    pub fn content_type(self) -> &'static str {
        match self {
            Framing::Ndjson => "application/x-ndjson",
            Framing::Sse => "text/event-stream",
        }
    }

    fn pick(self) -> fn(&Frame) -> &Bytes {
        match self {
            Framing::Ndjson => |f| &f.line,
            Framing::Sse => |f| &f.sse,
        }
    }

    pub fn transport(self) -> Transport {
        match self {
            Framing::Ndjson => Transport::Ndjson,
            Framing::Sse => Transport::Sse,
        }
    }

    fn keepalive(self) -> Bytes {
        match self {
            Framing::Ndjson => Bytes::from_static(b"\n"),
            Framing::Sse => Bytes::from_static(b": keep-alive\n\n"),
        }
    }
}

/// One watcher's stream.
pub struct Watch {
    pub cursor: Cursor,
    pub framing: Framing,
    /// End after the next `turn-sealed`.
    pub until_sealed: bool,
    /// Send `event: resync` before anything else.
    pub resync_first: bool,
    pub keepalive: Option<Duration>,
    pub store: Store,
    pub conversation_id: String,
    /// Shutdown: deliver what is available, then end.
    pub drained: tokio_util::sync::CancellationToken,
    pub metrics: Arc<Metrics>,
    /// Holds this stream's place under the cap until the body is dropped (never read).
    #[allow(dead_code)]
    pub permit: StreamPermit,
}

struct State {
    watch: Watch,
    ticker: Option<Interval>,
    /// Something went out since the last tick (no keep-alive is due then).
    sent: bool,
    drained: crate::net::Cancelled,
    resync: bool,
    done: bool,
}

/// The SSE message that tells a watcher to refetch history past its cursor.
pub async fn resync_message(store: &Store, conversation_id: &str) -> Bytes {
    let latest = store.latest_seq(conversation_id).await.unwrap_or(0);
    let data = serde_json::json!({"conversationId": conversation_id, "latestSeq": latest});
    Bytes::from(format!("event: resync\ndata: {data}\n\n"))
}

/// The body of a watcher: ends when the cursor ends, after `turn-sealed` with `until_sealed`,
/// or (NDJSON, which cannot say `resync`) when its position could not be refilled.
pub fn watch_body(watch: Watch) -> impl Stream<Item = Result<Bytes, Infallible>> + Send {
    let ticker = watch.keepalive.map(|period| {
        let mut t = tokio::time::interval_at(Instant::now() + period, period);
        t.set_missed_tick_behavior(MissedTickBehavior::Delay);
        t
    });
    let resync = watch.resync_first;
    let drained = crate::net::Cancelled::new(&watch.drained);
    let state = State { watch, ticker, sent: false, drained, resync, done: false };
    futures_util::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        if std::mem::take(&mut st.resync) {
            let message = resync_message(&st.watch.store, &st.watch.conversation_id).await;
            return Some((Ok(message), st));
        }
        let delivery = loop {
            tokio::select! {
                biased;
                d = st.watch.cursor.next_batch(BATCH) => break d,
                _ = tick(st.ticker.as_mut()) => {
                    // A keep-alive after a whole period of silence (so within two periods).
                    if !std::mem::take(&mut st.sent) {
                        return Some((Ok(st.watch.framing.keepalive()), st));
                    }
                }
                _ = &mut st.drained => break st.watch.cursor.try_batch(BATCH).unwrap_or(Delivery::End),
            }
        };
        match delivery {
            Delivery::Frames(frames) => {
                st.watch.metrics.events_delivered.fetch_add(frames.len() as u64, Relaxed);
                if st.watch.until_sealed && frames.last().is_some_and(|f| f.is_sealed()) {
                    st.done = true;
                }
                st.sent = true;
                Some((Ok(join_frames(&frames, st.watch.framing.pick())), st))
            }
            Delivery::Lost if st.watch.framing == Framing::Sse => {
                st.watch.metrics.lag_recoveries.fetch_add(1, Relaxed);
                let message = resync_message(&st.watch.store, &st.watch.conversation_id).await;
                Some((Ok(message), st))
            }
            Delivery::Lost => {
                st.watch.metrics.subscriber_drops.fetch_add(1, Relaxed);
                None
            }
            Delivery::End => None,
        }
    })
}

async fn tick(ticker: Option<&mut Interval>) {
    match ticker {
        Some(t) => {
            t.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// A 200 streaming response with the headers every live stream carries.
pub fn streaming_response(
    framing: Framing,
    body: impl Stream<Item = Result<Bytes, Infallible>> + Send + 'static,
) -> Response {
    let mut response = Response::new(Body::from_stream(body));
    *response.status_mut() = StatusCode::OK;
    let h = response.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(framing.content_type()));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}
