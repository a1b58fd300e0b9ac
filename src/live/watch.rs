//! One SSE or NDJSON watcher: what it writes and when it ends, decided here for every way of
//! writing it (a connection that writes the socket itself, or a response body under hyper).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use tokio::time::{Instant, Interval, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::Cancelled;
use crate::encoding::Transport;
use crate::encoding::{NDJSON_KEEPALIVE, SSE_KEEPALIVE, sse_named};
use crate::hub::{BATCH, Cursor, Delivery, Unparked};
use crate::metrics::{Metrics, StreamPermit};
use crate::store::Store;
use crate::wire::ErrorCode;

/// A watch's `Content-Type`: a watch is NDJSON or SSE (a WebSocket session is `live::Session`).
pub fn content_type(transport: Transport) -> &'static str {
    match transport {
        Transport::Ndjson => "application/x-ndjson",
        Transport::Sse => "text/event-stream",
        Transport::WebSocket => unreachable!("a watch is NDJSON or SSE"),
    }
}

/// A watch's keep-alive: an empty NDJSON line, or an SSE comment.
fn keepalive(transport: Transport) -> Bytes {
    Bytes::from_static(match transport {
        Transport::Ndjson => NDJSON_KEEPALIVE,
        Transport::Sse => SSE_KEEPALIVE,
        Transport::WebSocket => unreachable!("a watch is NDJSON or SSE"),
    })
}

/// What a route sets a watcher up with.
pub struct WatchSetup {
    pub cursor: Cursor,
    pub format: Transport,
    /// End after the next `turn-sealed`.
    pub until_sealed: bool,
    /// Send `event: resync` before anything else.
    pub resync_first: bool,
    pub keepalive: Option<Duration>,
    pub store: Store,
    pub conversation_id: String,
    /// Cancelled at shutdown once the turns have drained: deliver what is available, then end.
    pub drained: CancellationToken,
    pub metrics: Arc<Metrics>,
    /// Holds this stream's place under the cap until the stream ends.
    pub permit: StreamPermit,
}

/// One watcher's stream.
pub struct Watch {
    pub cursor: Cursor,
    pub format: Transport,
    until_sealed: bool,
    resync_first: bool,
    /// The caller may not see the conversation: it is watched as an id nobody has used, whose
    /// `resync` says `latestSeq` 0 (its log is never read), so no answer tells that it exists.
    blind: bool,
    store: Store,
    conversation_id: String,
    pub metrics: Arc<Metrics>,
    ticker: Option<Interval>,
    drained: Cancelled,
    /// Something went out since the last keep-alive tick (no keep-alive is due then).
    sent: bool,
    _permit: StreamPermit,
}

/// What a watcher woke up for.
pub enum Wake {
    Delivery(Delivery),
    /// The keep-alive period passed.
    Tick,
    /// The turns have drained at shutdown: what is available goes out, then the end.
    Drained,
}

/// What a watch's connection does next (a writer's action; a model's step is another thing).
pub enum Action {
    /// Write these bytes and go on.
    Write(Bytes),
    /// Write these bytes and end the stream.
    Last(Bytes),
    /// Nothing to write.
    Idle,
    /// End the stream now.
    End,
    /// Write these bytes (an `error` event saying why), then end the stream as a cut one: the
    /// connection closes without the body's end (no chunked last-chunk), so no client or proxy
    /// takes what it got for the whole of it.
    Cut(Bytes),
}

/// How long a cut stream served by hyper waits for its last bytes to be written before it fails.
const CUT_GRACE: Duration = Duration::from_secs(1);

/// How far a watch's body has come to its end.
#[derive(Clone, Copy)]
enum End {
    No,
    Whole,
    /// Its last bytes were written: the error that cuts it is due.
    Cut,
}

/// The log could not be read for a `resync`: never send a made-up `latestSeq`.
#[derive(Debug)]
pub struct Unreadable;

impl Watch {
    pub fn new(setup: WatchSetup) -> Watch {
        let ticker = setup.keepalive.map(|period| {
            let mut t = tokio::time::interval_at(Instant::now() + period, period);
            t.set_missed_tick_behavior(MissedTickBehavior::Delay);
            t
        });
        Watch {
            cursor: setup.cursor,
            format: setup.format,
            until_sealed: setup.until_sealed,
            resync_first: setup.resync_first,
            blind: false,
            store: setup.store,
            conversation_id: setup.conversation_id,
            metrics: setup.metrics,
            ticker,
            drained: Cancelled::new(&setup.drained),
            sent: false,
            _permit: setup.permit,
        }
    }

    /// Watches as an id nobody has used (see [`Watch::blind`]'s field).
    pub fn blind(&mut self) {
        self.blind = true;
    }

    /// What the stream opens with: `event: resync` when its cursor could not be resumed (ends
    /// the stream when the log cannot be read: the client comes back with its cursor).
    pub async fn opening(&mut self) -> Action {
        if !std::mem::take(&mut self.resync_first) {
            return Action::Idle;
        }
        if self.blind {
            let data = serde_json::json!({"conversationId": self.conversation_id, "latestSeq": 0});
            return self.wrote(Action::Write(sse_named("resync", &data.to_string())));
        }
        match resync_message(&self.store, &self.conversation_id, &self.cursor).await {
            Ok(message) => self.wrote(Action::Write(message)),
            Err(Unreadable) => Action::End,
        }
    }

    /// The action for what the watcher woke up for: a delivery's events (the last write with
    /// `until_sealed` once `turn-sealed` is among them), a `resync` (SSE) or the end (NDJSON,
    /// which cannot say `resync`) when its position was coalesced away, a keep-alive after a
    /// whole period of silence (so within two periods), and at shutdown what is available.
    pub async fn next(&mut self, wake: Wake) -> Action {
        let delivery = match wake {
            Wake::Delivery(delivery) => delivery,
            Wake::Tick if std::mem::take(&mut self.sent) => return Action::Idle,
            Wake::Tick => return Action::Write(keepalive(self.format)),
            // The credential that opened the stream was taken back: it ends now, saying why.
            Wake::Drained if let Some(why) = self._permit.ended() => {
                let message = format!("this stream's credential was taken back: {why}");
                return self.cut(&message, ErrorCode::Unauthorized);
            }
            Wake::Drained => match self.cursor.try_batch(BATCH) {
                Some(delivery) => delivery,
                // Shutdown with a turn still unsealed under the cursor: it ends cut, saying so.
                None if self.cursor.position().is_some() => {
                    return self.cut("the gateway is shutting down before this turn's end", ErrorCode::Shutdown);
                }
                None => Delivery::End,
            },
        };
        let action = match delivery {
            Delivery::Events(events) => {
                self.metrics.deliveries.events.fetch_add(events.len() as u64, Relaxed);
                let bytes = self.format.join(&events);
                if self.until_sealed && events.last().is_some_and(|e| e.is_sealed()) {
                    Action::Last(bytes)
                } else {
                    Action::Write(bytes)
                }
            }
            Delivery::Lost { .. } if self.format == Transport::Sse => {
                self.metrics.lag_recoveries.fetch_add(1, Relaxed);
                if self.blind {
                    let data = serde_json::json!({"conversationId": self.conversation_id, "latestSeq": 0});
                    return self.wrote(Action::Write(sse_named("resync", &data.to_string())));
                }
                match resync_message(&self.store, &self.conversation_id, &self.cursor).await {
                    Ok(message) => Action::Write(message),
                    Err(Unreadable) => self.cut("the log could not be read to resync this stream", ErrorCode::Storage),
                }
            }
            // NDJSON cannot say `resync`: the watcher is cut, and reads history for the rest.
            Delivery::Lost { turn_id } => {
                self.metrics.subscriber_drops.fetch_add(1, Relaxed);
                self.cut_in(
                    &turn_id,
                    "this stream fell too far behind the turn; read the history for the rest",
                    ErrorCode::Lagged,
                )
            }
            Delivery::End => Action::End,
        };
        self.wrote(action)
    }

    /// What the rounds wrote while the stream was parked; whether the stream ends there (they
    /// wrote `turn-sealed` and the stream ends with it).
    pub fn unparked(&mut self, back: &Unparked) -> bool {
        self.sent |= back.sent;
        back.sealed && self.until_sealed
    }

    /// The action that ends the stream cut, with an `error` event (`code`) for the turn it reads.
    fn cut(&self, message: &str, code: ErrorCode) -> Action {
        let turn_id = self.cursor.replaying().unwrap_or_else(|| Arc::from(""));
        self.cut_in(&turn_id, message, code)
    }

    fn cut_in(&self, turn_id: &str, message: &str, code: ErrorCode) -> Action {
        let error = crate::wire::AgentEvent::Error(crate::wire::TurnErrorEvent {
            conversation_id: self.conversation_id.clone(),
            turn_id: turn_id.to_owned(),
            message: message.to_owned(),
            code: Some(code),
        });
        let json = serde_json::to_string(&error).expect("an event serializes");
        Action::Cut(Bytes::from(if self.format == Transport::Sse {
            format!("data: {json}\n\n")
        } else {
            format!("{json}\n")
        }))
    }

    fn wrote(&mut self, action: Action) -> Action {
        if matches!(action, Action::Write(_) | Action::Last(_)) {
            self.sent = true;
        }
        action
    }

    /// Ready when the keep-alive period passed or shutdown began (the wakes that are not a
    /// delivery); polled by every way of waiting for one.
    pub fn poll_timers(&mut self, cx: &mut Context<'_>) -> Poll<Wake> {
        if self.ticker.as_mut().is_some_and(|t| t.poll_tick(cx).is_ready()) {
            return Poll::Ready(Wake::Tick);
        }
        if Pin::new(&mut self.drained).poll(cx).is_ready() {
            return Poll::Ready(Wake::Drained);
        }
        Poll::Pending
    }

    /// Waits for the next wake: a delivery first, then the timers.
    pub async fn wake(&mut self) -> Wake {
        let Watch { cursor, ticker, drained, .. } = self;
        let delivery = cursor.next_batch(BATCH);
        tokio::pin!(delivery);
        std::future::poll_fn(|cx| {
            if let Poll::Ready(d) = delivery.as_mut().poll(cx) {
                return Poll::Ready(Wake::Delivery(d));
            }
            if ticker.as_mut().is_some_and(|t| t.poll_tick(cx).is_ready()) {
                return Poll::Ready(Wake::Tick);
            }
            Pin::new(&mut *drained).poll(cx).map(|()| Wake::Drained)
        })
        .await
    }

    /// The watcher as a response body, for a connection served by hyper: the same actions, one
    /// chunk per write.
    /// A cut stream ends with an error, on which hyper closes the connection without the
    /// body's end.
    pub fn into_body(self) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send {
        futures_util::stream::unfold((self, true, End::No), |(mut watch, first, end)| async move {
            match end {
                End::No => {}
                End::Whole => return None,
                End::Cut => {
                    // hyper drops what it has not flushed when a body fails: the error event
                    // is given a moment to go out first. (The body's end is withheld either way.)
                    tokio::time::sleep(CUT_GRACE).await;
                    let cut = std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "the stream was cut");
                    return Some((Err(cut), (watch, false, End::Whole)));
                }
            }
            let mut action = if first { watch.opening().await } else { Action::Idle };
            loop {
                match action {
                    Action::Write(bytes) => return Some((Ok(bytes), (watch, false, End::No))),
                    Action::Last(bytes) => return Some((Ok(bytes), (watch, false, End::Whole))),
                    Action::Cut(bytes) => return Some((Ok(bytes), (watch, false, End::Cut))),
                    Action::End => return None,
                    Action::Idle => {}
                }
                let wake = watch.wake().await;
                action = watch.next(wake).await;
            }
        })
    }
}

/// The SSE message that tells a watcher to refetch history past its cursor, up to where the
/// turn `cursor` replays begins.
pub async fn resync_message(store: &Store, conversation_id: &str, cursor: &Cursor) -> Result<Bytes, Unreadable> {
    let latest = horizon(store, conversation_id, cursor).await.map_err(|e| {
        tracing::error!(conversation_id, error = %e, "cannot read the log for a resync; ending the stream");
        Unreadable
    })?;
    let data = serde_json::json!({"conversationId": conversation_id, "latestSeq": latest});
    Ok(sse_named("resync", &data.to_string()))
}

/// The `latestSeq` of a resync: the history horizon, but never past the start of the turn the
/// cursor replays, which may have sealed (moving the horizon past it) since the cursor took it.
/// A turn that begins only while the horizon is read is looked up again: it may have sealed
/// before the read.
pub async fn horizon(store: &Store, conversation_id: &str, cursor: &Cursor) -> crate::store::StoreResult<u64> {
    let known = cursor.replaying();
    let latest = store.latest_seq(conversation_id, known.as_deref()).await?;
    match (known, cursor.replaying()) {
        (None, Some(begun)) => Ok(latest.min(store.latest_seq(conversation_id, Some(&begun)).await?)),
        _ => Ok(latest),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::{FlushWindow, Hub};

    async fn begin(store: &Store, turn_id: &str) {
        store.begin_test_turn("c", turn_id).await;
    }

    async fn seal(store: &Store, turn_id: &str) {
        store.seal_test_turn("c", turn_id, None, &[]).await.unwrap();
    }

    #[tokio::test]
    async fn a_resync_never_points_past_the_start_of_the_turn_the_stream_replays() {
        let dir = tempfile::tempdir().unwrap();
        let store =
            Store::open(&crate::config::Database::Sqlite(dir.path().join("horizon.db")), Arc::new(Metrics::default()))
                .await
                .unwrap();
        let hub = Hub::new(1 << 20, FlushWindow::default());
        // t1 is history (seq 1); t2 (seq 2) is in flight when the watcher subscribes.
        begin(&store, "t1").await;
        seal(&store, "t1").await;
        begin(&store, "t2").await;
        let buffer = hub.begin_turn("c", "t2", &[]);
        let (cursor, _) = hub.subscribe("c", None).await;
        assert_eq!(horizon(&store, "c", &cursor).await.unwrap(), 1);
        // t2 seals before the watcher reads the horizon: the stream replays t2 all the same, so
        // the history it points at still ends before t2.
        seal(&store, "t2").await;
        assert_eq!(store.latest_seq("c", None).await.unwrap(), 2);
        assert_eq!(horizon(&store, "c", &cursor).await.unwrap(), 1);
        let sealed = crate::wire::TurnSealedEvent { conversation_id: "c".into(), turn_id: "t2".into() };
        hub.seal_turn(buffer, &crate::wire::AgentEvent::TurnSealed(sealed));

        // A watcher that subscribed between turns replays the next one, even if it has sealed
        // by the time the horizon is read.
        let (waiting, _) = hub.subscribe("c", None).await;
        assert_eq!(horizon(&store, "c", &waiting).await.unwrap(), 2);
        begin(&store, "t3").await;
        let _t3 = hub.begin_turn("c", "t3", &[]);
        seal(&store, "t3").await;
        assert_eq!(horizon(&store, "c", &waiting).await.unwrap(), 2);
    }
}
