//! An event as the hub holds it: encoded once for every transport.

use std::sync::{Arc, OnceLock};

use bytes::{Bytes, BytesMut};

use crate::encoding::{Transport, WS_TEXT, put_ndjson, put_sse_event, put_ws_frame, ws_chat_delta, ws_frame_len};
use crate::wire::AgentEvent;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Text,
    Reasoning,
    Sealed,
    Other,
}

impl Kind {
    /// Text and reasoning deltas: the events a round may hold back, and the only ones coalesced.
    pub(super) fn is_delta(self) -> bool {
        matches!(self, Kind::Text | Kind::Reasoning)
    }
}

/// One event (or a coalesced run of deltas), encoded once for every transport.
#[derive(Debug)]
pub struct EncodedEvent {
    /// 0-based index of the (first) event in its turn.
    pub first: u32,
    /// Index of the last event this one stands for (`first` unless coalesced). The SSE id is
    /// `<turnId>:<last>`, so resuming after it is exact.
    pub last: u32,
    pub(super) kind: Kind,
    /// The JSON object followed by `\n`.
    pub line: Bytes,
    /// `id: <turnId>:<last>\ndata: <json>\n\n`.
    pub sse: Bytes,
    /// `{"type":"chat.delta","event":<json>}`, built the first time a WebSocket needs it.
    ws: OnceLock<Bytes>,
}

impl EncodedEvent {
    pub(super) fn new(turn_id: &str, first: u32, last: u32, event: &AgentEvent) -> EncodedEvent {
        let (kind, json) = EncodedEvent::encode(event);
        EncodedEvent::build(turn_id, first, last, kind, &json)
    }

    /// The event's kind and JSON: the part of encoding that needs no index (done outside the
    /// buffer's lock).
    pub(super) fn encode(event: &AgentEvent) -> (Kind, Vec<u8>) {
        let kind = match event {
            AgentEvent::TextDelta(_) => Kind::Text,
            AgentEvent::ReasoningDelta(_) => Kind::Reasoning,
            AgentEvent::TurnSealed(_) => Kind::Sealed,
            _ => Kind::Other,
        };
        (kind, serde_json::to_vec(event).expect("wire types always serialize"))
    }

    pub(super) fn build(turn_id: &str, first: u32, last: u32, kind: Kind, json: &[u8]) -> EncodedEvent {
        let mut line = BytesMut::new();
        put_ndjson(&mut line, json);
        let mut sse = BytesMut::new();
        put_sse_event(&mut sse, turn_id, last, json);
        EncodedEvent { first, last, kind, line: line.freeze(), sse: sse.freeze(), ws: OnceLock::new() }
    }

    /// The event wrapped as a WebSocket `chat.delta` message (JSON text).
    pub fn ws(&self) -> &Bytes {
        self.ws.get_or_init(|| Bytes::from(ws_chat_delta(&self.line[..self.line.len() - 1])))
    }

    /// True for `turn-sealed`, the last event of a turn.
    pub fn is_sealed(&self) -> bool {
        self.kind == Kind::Sealed
    }

    pub(super) fn size(&self) -> usize {
        // The WebSocket copy is about one line long once built; count it up front.
        2 * self.line.len() + self.sse.len() + std::mem::size_of::<EncodedEvent>()
    }

    /// The delta text of a text or reasoning event.
    pub(super) fn delta(&self) -> Option<String> {
        match serde_json::from_slice::<AgentEvent>(&self.line).ok()? {
            AgentEvent::TextDelta(e) => Some(e.delta),
            AgentEvent::ReasoningDelta(e) => Some(e.delta),
            _ => None,
        }
    }
}

/// An event in a transport's framing (each kept once per event, `EncodedEvent`).
impl Transport {
    /// The event's length in this encoding.
    pub fn len(self, event: &EncodedEvent) -> usize {
        match self {
            Transport::Ndjson => event.line.len(),
            Transport::Sse => event.sse.len(),
            Transport::WebSocket => ws_frame_len(event.ws().len()),
        }
    }

    /// Appends the event in this encoding.
    pub fn put(self, out: &mut BytesMut, event: &EncodedEvent) {
        match self {
            Transport::Ndjson => out.extend_from_slice(&event.line),
            Transport::Sse => out.extend_from_slice(&event.sse),
            Transport::WebSocket => put_ws_frame(out, WS_TEXT, event.ws()),
        }
    }

    /// A batch of events as one buffer (shared, for a single event stored in this encoding), so
    /// that a batch costs one socket write.
    pub fn join(self, events: &[Arc<EncodedEvent>]) -> Bytes {
        match (self, events) {
            (Transport::Ndjson, [one]) => one.line.clone(),
            (Transport::Sse, [one]) => one.sse.clone(),
            (_, many) => {
                let mut out = BytesMut::with_capacity(many.iter().map(|e| self.len(e)).sum());
                for e in many {
                    self.put(&mut out, e);
                }
                out.freeze()
            }
        }
    }
}
