//! Turning a hub cursor into a streaming response body: batches of pre-framed bytes (one chunk
//! a batch), keep-alives, and `resync` when a watcher's position cannot be refilled.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use tokio::time::{Instant, Interval, MissedTickBehavior};

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use crate::hub::{Cursor, Delivery, Framed, join_frames};
use crate::metrics::{Metrics, StreamPermit, Transport};
use crate::store::Store;

/// Most frames joined into one write: enough to make a write carry many events under load,
/// few enough (tens of KiB) that a lagging connection holds little beside the shared buffer.
pub const BATCH: usize = 128;

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

    pub fn transport(self) -> Transport {
        match self {
            Framing::Ndjson => Transport::Ndjson,
            Framing::Sse => Transport::Sse,
        }
    }

    /// Which of a frame's pre-built framings this stream writes.
    pub fn framed(self) -> Framed {
        match self {
            Framing::Ndjson => Framed::Line,
            Framing::Sse => Framed::Sse,
        }
    }

    pub fn keepalive(self) -> Bytes {
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
    done: bool,
}

impl Watch {
    /// What a delivery puts on the wire: the bytes, and whether the stream ends after them;
    /// `None` when it ends now.
    pub async fn outcome(&mut self, delivery: Delivery) -> Option<(Bytes, bool)> {
        match delivery {
            Delivery::Frames(frames) => {
                self.metrics.events_delivered.fetch_add(frames.len() as u64, Relaxed);
                let last = self.until_sealed && frames.last().is_some_and(|f| f.is_sealed());
                Some((join_frames(&frames, self.framing.framed()), last))
            }
            Delivery::Lost if self.framing == Framing::Sse => {
                self.metrics.lag_recoveries.fetch_add(1, Relaxed);
                // Unreadable log: the stream ends and the client comes back with its cursor.
                resync_message(&self.store, &self.conversation_id).await.ok().map(|m| (m, false))
            }
            Delivery::Lost => {
                self.metrics.subscriber_drops.fetch_add(1, Relaxed);
                None
            }
            Delivery::End => None,
        }
    }

    /// The `event: resync` message, when the stream must open with one (once); an error when
    /// the log cannot be read (the stream must end: the client comes back with its cursor).
    pub async fn resync(&mut self) -> Result<Option<Bytes>, Unreadable> {
        if !std::mem::take(&mut self.resync_first) {
            return Ok(None);
        }
        resync_message(&self.store, &self.conversation_id).await.map(Some)
    }

    /// The keep-alive ticker (the first tick one period from now).
    pub fn ticker(&self) -> Option<Interval> {
        self.keepalive.map(|period| {
            let mut t = tokio::time::interval_at(Instant::now() + period, period);
            t.set_missed_tick_behavior(MissedTickBehavior::Delay);
            t
        })
    }
}

/// The log could not be read for a `resync`: never send a made-up `latestSeq`.
#[derive(Debug)]
pub struct Unreadable;

/// The SSE message that tells a watcher to refetch history past its cursor.
pub async fn resync_message(store: &Store, conversation_id: &str) -> Result<Bytes, Unreadable> {
    let latest = store.latest_seq(conversation_id).await.map_err(|e| {
        tracing::error!(conversation_id, error = %e, "cannot read the log for a resync; ending the stream");
        Unreadable
    })?;
    let data = serde_json::json!({"conversationId": conversation_id, "latestSeq": latest});
    Ok(Bytes::from(format!("event: resync\ndata: {data}\n\n")))
}

/// The body of a watcher: ends when the cursor ends, after `turn-sealed` with `until_sealed`,
/// or (NDJSON, which cannot say `resync`) when its position could not be refilled.
pub fn watch_body(watch: Watch) -> impl Stream<Item = Result<Bytes, Infallible>> + Send {
    let ticker = watch.ticker();
    let drained = crate::net::Cancelled::new(&watch.drained);
    let state = State { watch, ticker, sent: false, drained, done: false };
    futures_util::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        match st.watch.resync().await {
            Ok(Some(message)) => return Some((Ok(message), st)),
            Ok(None) => {}
            Err(Unreadable) => return None,
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
        let (bytes, last) = st.watch.outcome(delivery).await?;
        st.sent = true;
        st.done = last;
        Some((Ok(bytes), st))
    })
}

/// A watcher's streaming response. A connection that writes responses itself
/// (`net::direct`) may take the [`Watch`] out of it ([`TakeWatch`]) instead of polling the body,
/// which is then empty.
pub fn watch_response(watch: Watch) -> Response {
    let framing = watch.framing;
    let slot = Arc::new(Mutex::new(Some(watch)));
    let taken = slot.clone();
    let body = futures_util::stream::once(async move { taken.lock().unwrap_or_else(|p| p.into_inner()).take() })
        .filter_map(std::future::ready)
        .flat_map(watch_body);
    let mut response = streaming_response(framing, body);
    response.extensions_mut().insert(TakeWatch(slot));
    response
}

/// The [`Watch`] behind a [`watch_response`], for whoever serves it first.
#[derive(Clone)]
pub struct TakeWatch(Arc<Mutex<Option<Watch>>>);

impl TakeWatch {
    pub fn take(&self) -> Option<Watch> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// The ticker's next tick; never, without one.
pub async fn tick(ticker: Option<&mut Interval>) {
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
