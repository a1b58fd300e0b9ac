//! An event encoded once for every transport (as the hub holds it), and a batch of them framed
//! for one transport's socket.

use std::sync::{Arc, OnceLock};

use bytes::{Bytes, BytesMut};

use super::{
    CHUNK_END, Transport, WS_TEXT, chunk_size, put_ndjson, put_sse_event, put_ws_frame, ws_chat_delta, ws_frame_len,
};
use crate::wire::AgentEvent;

/// What an event is, as far as fan-out cares: deltas may be held back and coalesced, and
/// `turn-sealed` ends a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Text,
    Reasoning,
    Sealed,
    Other,
}

impl Kind {
    /// Text and reasoning deltas: the events a round may hold back, and the only ones coalesced.
    #[inline]
    pub fn is_delta(self) -> bool {
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
    pub kind: Kind,
    /// The JSON object followed by `\n`.
    pub line: Bytes,
    /// `id: <turnId>:<last>\ndata: <json>\n\n`.
    pub sse: Bytes,
    /// `{"type":"chat.delta","event":<json>}`, built the first time a WebSocket needs it.
    ws: OnceLock<Bytes>,
}

impl EncodedEvent {
    pub fn new(turn_id: &str, first: u32, last: u32, event: &AgentEvent) -> EncodedEvent {
        let (kind, json) = EncodedEvent::encode(event);
        EncodedEvent::build(turn_id, first, last, kind, &json)
    }

    /// The event's kind and JSON: the part of encoding that needs no index (done outside the
    /// buffer's lock).
    pub fn encode(event: &AgentEvent) -> (Kind, Vec<u8>) {
        let kind = match event {
            AgentEvent::TextDelta(_) => Kind::Text,
            AgentEvent::ReasoningDelta(_) => Kind::Reasoning,
            AgentEvent::TurnSealed(_) => Kind::Sealed,
            _ => Kind::Other,
        };
        (kind, serde_json::to_vec(event).expect("wire types always serialize"))
    }

    pub fn build(turn_id: &str, first: u32, last: u32, kind: Kind, json: &[u8]) -> EncodedEvent {
        let mut line = BytesMut::new();
        put_ndjson(&mut line, json);
        let mut sse = BytesMut::new();
        put_sse_event(&mut sse, turn_id, last, json);
        EncodedEvent { first, last, kind, line: line.freeze(), sse: sse.freeze(), ws: OnceLock::new() }
    }

    /// The event wrapped as a WebSocket `chat.delta` message (JSON text).
    #[inline]
    pub fn ws(&self) -> &Bytes {
        self.ws.get_or_init(|| Bytes::from(ws_chat_delta(&self.line[..self.line.len() - 1])))
    }

    /// True for `turn-sealed`, the last event of a turn.
    #[inline]
    pub fn is_sealed(&self) -> bool {
        self.kind == Kind::Sealed
    }

    pub fn size(&self) -> usize {
        // The WebSocket copy is about one line long once built; count it up front.
        2 * self.line.len() + self.sse.len() + std::mem::size_of::<EncodedEvent>()
    }

    /// The delta text of a text or reasoning event.
    pub fn delta(&self) -> Option<String> {
        match serde_json::from_slice::<AgentEvent>(&self.line).ok()? {
            AgentEvent::TextDelta(e) => Some(e.delta),
            AgentEvent::ReasoningDelta(e) => Some(e.delta),
            _ => None,
        }
    }
}

/// An event in a transport's framing (each kept once per event, `EncodedEvent`).
impl Transport {
    /// The events as one write on a stream of this transport: an HTTP/1.1 chunk of SSE
    /// messages or NDJSON lines, or one WebSocket frame per event.
    pub fn frame(self, events: &[Arc<EncodedEvent>]) -> Bytes {
        let len: usize = events.iter().map(|e| self.len(e)).sum();
        let mut head = [0u8; 18];
        let head = if self == Transport::WebSocket { &[][..] } else { chunk_size(&mut head, len) };
        let mut out = BytesMut::with_capacity(head.len() + len + CHUNK_END.len());
        out.extend_from_slice(head);
        for e in events {
            self.put(&mut out, e);
        }
        if self != Transport::WebSocket {
            out.extend_from_slice(CHUNK_END);
        }
        out.freeze()
    }

    /// The event's length in this encoding.
    #[inline]
    pub fn len(self, event: &EncodedEvent) -> usize {
        match self {
            Transport::Ndjson => event.line.len(),
            Transport::Sse => event.sse.len(),
            Transport::WebSocket => ws_frame_len(event.ws().len()),
        }
    }

    /// Appends the event in this encoding.
    #[inline]
    pub fn put(self, out: &mut BytesMut, event: &EncodedEvent) {
        match self {
            Transport::Ndjson => out.extend_from_slice(&event.line),
            Transport::Sse => out.extend_from_slice(&event.sse),
            Transport::WebSocket => put_ws_frame(out, WS_TEXT, event.ws()),
        }
    }

    /// A batch of events as one buffer (shared, for a single event stored in this encoding), so
    /// that a batch costs one socket write.
    #[inline]
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
