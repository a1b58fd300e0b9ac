//! The end of a turn whose gateway died, published by the gateway that marked it interrupted.

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;

use super::{BusError, Head, message_head, message_headers, message_part, more_subject, open_subject};
use crate::store::INTERRUPTED_MESSAGE;
use crate::wire::{AgentEvent, ErrorCode, TurnDoneEvent, TurnErrorEvent, TurnSealedEvent};

/// After this gateway marked a turn interrupted whose gateway is gone: ends the turn on the
/// bus, for the watchers of every gateway, as the log now ends it (`error{interrupted}` and
/// `done` unless the turn had its `done`, then `turn-sealed`), numbered on from the last event
/// the turn published. The message names the turn's own gateway, so that every other one
/// (this one included) reads it like the turn's own end. It is placed only right after the
/// turn's last message (an expected-sequence check), retried if another message came between.
pub(super) async fn end_interrupted(bus: &super::Bus, conversation_id: &str, turn_id: &str) -> Result<(), BusError> {
    let inner = &bus.0;
    let (open, more) = (open_subject(conversation_id), more_subject(conversation_id));
    for _ in 0..5 {
        let last_more = inner.shared.last_message(&more).await?;
        let last_open = inner.shared.last_message(&open).await?;
        // The turn's last message: the later of its latest `more` and `open` (a turn sent again
        // from its start has an `open` after its `more`s).
        let of_turn = |m: &Option<async_nats::jetstream::message::StreamMessage>| {
            m.as_ref().and_then(|m| {
                let (node, turn, index) = message_head(inner, &m.subject, Some(&m.headers), &m.payload)?;
                let part = message_part(Some(&m.headers));
                (turn == turn_id).then(|| (m.sequence, node, index, part, m.payload.clone()))
            })
        };
        let latest = of_turn(&last_more).into_iter().chain(of_turn(&last_open)).max_by_key(|(sequence, ..)| *sequence);
        let Some((_, node, index, part, payload)) = latest else {
            return Ok(()); // nothing of the turn reached the bus: no watcher elsewhere saw it
        };
        // A part of a large event: the event counts once its last part is there; before, the end
        // takes its place (a follower drops the parts it gathered when another message comes).
        let lines: Vec<&[u8]> = match part {
            Some((k, n)) if k == n => vec![&b"{}"[..]],
            Some(_) => Vec::new(),
            None => payload.split(|b| *b == b'\n').filter(|l| !l.is_empty()).collect(),
        };
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
                code: Some(ErrorCode::Interrupted),
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
        let head = Head { subject: &more, node: &node, turn_id, index: next, part: None };
        let body = bytes::Bytes::from(body);
        let message = PublishMessage::build()
            .headers(message_headers(&inner.signer, head, &body))
            .expected_last_subject_sequence(expected)
            .payload(body);
        let sent = inner.js.send_publish(more.clone(), message).await.map_err(BusError::js)?;
        match sent.await {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => continue,
            Err(e) => return Err(BusError::js(e)),
        }
    }
    Err(BusError::JetStream("the turn's subject kept moving; its end was not published".into()))
}
