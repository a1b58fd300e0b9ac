//! The events of this gateway's turns, out to the stream; and the end of a turn whose gateway
//! died, from the gateway that marked it interrupted.

use std::future::IntoFuture;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use async_nats::HeaderMap;
use async_nats::jetstream::context::{PublishAckFuture, PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::sync::mpsc;

use super::{BusError, INDEX, Inner, NODE, TURN, message_head, more_subject, open_subject};
use crate::hub::{Outbox, Outgoing};
use crate::store::INTERRUPTED_MESSAGE;
use crate::wire::{AgentEvent, TurnDoneEvent, TurnErrorEvent, TurnSealedEvent};

/// A message stays well under NATS's payload limit (1 MiB unless the server says otherwise).
const HEADROOM: usize = 4096;

pub(super) fn outbox(inner: &Arc<Inner>, conversation_id: &str, turn_id: &str, cap: usize) -> Outbox {
    let (outbox, events, pending) = Outbox::new(cap);
    let turn = Turn {
        inner: inner.clone(),
        open: open_subject(conversation_id),
        more: more_subject(conversation_id),
        turn_id: turn_id.to_owned(),
    };
    tokio::spawn(turn.publish(events, pending));
    outbox
}

struct Turn {
    inner: Arc<Inner>,
    open: String,
    more: String,
    turn_id: String,
}

impl Turn {
    /// Publishes what the turn's outbox gets, in order, each burst as few messages as fit,
    /// without waiting for one's acknowledgement before sending the next; ends with the turn.
    async fn publish(self, mut events: mpsc::UnboundedReceiver<Outgoing>, pending: Arc<AtomicUsize>) {
        let limit = (self.inner.client.server_info().max_payload.max(2 * HEADROOM) - HEADROOM).max(HEADROOM);
        let mut acks = FuturesUnordered::new();
        let mut burst: Vec<Outgoing> = Vec::new();
        // Messages the bus did not take.
        let mut misses = 0;
        let mut ended = false;
        while !ended {
            tokio::select! {
                got = events.recv() => {
                    let Some(first) = got else { break };
                    burst.push(first);
                    while let Ok(more) = events.try_recv() {
                        burst.push(more);
                    }
                    pending.fetch_sub(burst.iter().map(|e| e.line.len()).sum(), Relaxed);
                    ended = burst.iter().any(|e| e.last);
                    for (index, payload) in runs(&burst, limit) {
                        match self.send(index, payload).await {
                            Ok(ack) => acks.push(ack.into_future()),
                            Err(e) => self.missed(&mut misses, e, false).await,
                        }
                    }
                    burst.clear();
                }
                Some(ack) = acks.next(), if !acks.is_empty() => self.acked(&mut misses, ack).await,
            }
        }
        while let Some(ack) = acks.next().await {
            self.acked(&mut misses, ack).await;
        }
        if misses > 1 {
            tracing::warn!(turn = %self.turn_id, messages = misses, "the bus did not take messages of a turn");
        }
    }

    async fn acked(&self, misses: &mut usize, ack: Result<PublishAck, PublishError>) {
        if let Err(e) = ack {
            let gone = e.kind() == PublishErrorKind::StreamNotFound;
            self.missed(misses, e, gone).await;
        }
    }

    /// A message the bus did not take: the first of a turn is logged (a bus that is down fails
    /// them all), the others counted; a stream found gone is created again (`restore` asks NATS
    /// at most once a second, whoever calls).
    async fn missed(&self, misses: &mut usize, error: impl std::fmt::Display, stream_gone: bool) {
        if *misses == 0 {
            tracing::warn!(turn = %self.turn_id, error = %error, "the bus did not take a turn's events");
        }
        *misses += 1;
        if stream_gone && let Err(e) = self.inner.shared.restore(&self.inner.js).await {
            tracing::warn!(error = %e, "cannot create the bus's stream again");
        }
    }

    async fn send(&self, index: u32, payload: Bytes) -> Result<PublishAckFuture, BusError> {
        let subject = if index == 0 { &self.open } else { &self.more };
        let message = PublishMessage::build().headers(head(&self.inner.node, &self.turn_id, index)).payload(payload);
        self.inner.js.send_publish(subject.clone(), message).await.map_err(BusError::js)
    }
}

/// A burst as messages: runs of consecutive indices (an overflow leaves a gap), each under
/// `limit` bytes unless one event alone is larger (the server then refuses it: a gap too).
fn runs(burst: &[Outgoing], limit: usize) -> Vec<(u32, Bytes)> {
    let mut out = Vec::new();
    let mut current: Option<(u32, u32, BytesMut)> = None;
    for event in burst {
        let fits = current
            .as_ref()
            .is_some_and(|(_, next, payload)| *next == event.index && payload.len() + event.line.len() <= limit);
        if !fits && let Some((first, _, payload)) = current.take() {
            out.push((first, payload.freeze()));
        }
        let (_, next, payload) = current.get_or_insert_with(|| (event.index, event.index, BytesMut::new()));
        payload.extend_from_slice(&event.line);
        *next = event.index + 1;
    }
    if let Some((first, _, payload)) = current {
        out.push((first, payload.freeze()));
    }
    out
}

fn head(node: &str, turn_id: &str, index: u32) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(NODE, node);
    headers.insert(TURN, turn_id);
    headers.insert(INDEX, index.to_string().as_str());
    headers
}

/// After this gateway marked a turn interrupted whose gateway is gone: ends the turn on the
/// bus, for the watchers of every gateway, as the log now ends it (`error{interrupted}` and
/// `done` unless the turn had its `done`, then `turn-sealed`), numbered on from the last event
/// the turn published. The message names the turn's own gateway, so that every other one
/// (this one included) reads it like the turn's own end. It is placed only right after the
/// turn's last message (an expected-sequence check), retried if another message came between.
pub async fn end_interrupted(bus: &super::Bus, conversation_id: &str, turn_id: &str) -> Result<(), BusError> {
    let inner = &bus.0;
    let (open, more) = (open_subject(conversation_id), more_subject(conversation_id));
    for _ in 0..5 {
        let last_more = last_message(inner, &more).await?;
        let last_open = last_message(inner, &open).await?;
        // The turn's last message: its latest `more`, else its `open`.
        let of_turn = |m: &Option<async_nats::jetstream::message::StreamMessage>| {
            m.as_ref().and_then(|m| {
                let (node, turn, index) = message_head(Some(&m.headers))?;
                (turn == turn_id).then(|| (node, index, m.payload.clone()))
            })
        };
        let Some((node, index, payload)) = of_turn(&last_more).or_else(|| of_turn(&last_open)) else {
            return Ok(()); // nothing of the turn reached the bus: no watcher elsewhere saw it
        };
        let lines: Vec<&[u8]> = payload.split(|b| *b == b'\n').filter(|l| !l.is_empty()).collect();
        let last_event = lines.last().and_then(|l| serde_json::from_slice::<AgentEvent>(l).ok());
        if matches!(last_event, Some(AgentEvent::TurnSealed(_))) {
            return Ok(()); // it ended on the bus after all
        }
        let had_done = lines.iter().any(|l| matches!(serde_json::from_slice(l), Ok(AgentEvent::Done(_))));
        let ids = || (conversation_id.to_owned(), turn_id.to_owned());
        let mut events = Vec::new();
        if !had_done {
            let (conversation_id, turn_id) = ids();
            events.push(AgentEvent::Error(TurnErrorEvent {
                conversation_id: conversation_id.clone(),
                turn_id: turn_id.clone(),
                message: INTERRUPTED_MESSAGE.to_owned(),
                code: Some("interrupted".into()),
            }));
            events.push(AgentEvent::Done(TurnDoneEvent {
                conversation_id,
                turn_id,
                reason: "error".into(),
                duration_ms: None,
                usage: None,
                context_size: None,
            }));
        }
        let (conversation_id, sealed_turn) = ids();
        events.push(AgentEvent::TurnSealed(TurnSealedEvent { conversation_id, turn_id: sealed_turn }));
        let mut body = Vec::new();
        for event in &events {
            serde_json::to_writer(&mut body, event).expect("wire types always serialize");
            body.push(b'\n');
        }
        let next = index + lines.len() as u32;
        let expected = last_more.as_ref().map_or(0, |m| m.sequence);
        let message = PublishMessage::build()
            .headers(head(&node, turn_id, next))
            .expected_last_subject_sequence(expected)
            .payload(body.into());
        let sent = inner.js.send_publish(more.clone(), message).await.map_err(BusError::js)?;
        match sent.await {
            Ok(_) => return Ok(()),
            Err(e) if e.to_string().contains("wrong last sequence") => continue,
            Err(e) => return Err(BusError::js(e)),
        }
    }
    Err(BusError::JetStream("the turn's subject kept moving; its end was not published".into()))
}

pub(super) async fn last_message(
    inner: &Inner,
    subject: &str,
) -> Result<Option<async_nats::jetstream::message::StreamMessage>, BusError> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    match inner.shared.stream.get_last_raw_message_by_subject(subject).await {
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(BusError::js(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(index: u32, line: &str) -> Outgoing {
        Outgoing { index, line: Bytes::from(format!("{line}\n")), last: false }
    }

    #[test]
    fn a_burst_goes_out_as_runs_of_consecutive_events_under_the_limit() {
        let burst = [ev(0, "a"), ev(1, "b"), ev(2, "c"), ev(3, "dddddd"), ev(7, "e"), ev(8, "f")];
        let got: Vec<(u32, String)> =
            runs(&burst, 6).into_iter().map(|(i, p)| (i, String::from_utf8(p.to_vec()).unwrap())).collect();
        // Runs cut by the limit and by the gap an overflow left; an event over the limit alone.
        assert_eq!(got, vec![(0, "a\nb\nc\n".to_owned()), (3, "dddddd\n".to_owned()), (7, "e\nf\n".to_owned())]);
    }
}
