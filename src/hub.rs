//! Fan-out of turn events: per-conversation replay buffers that every transport reads from.
//!
//! A turn publishes into its [`TurnBuffer`]; each event is framed once (an NDJSON line and an
//! SSE message, both shared [`Bytes`]). Watchers do not get a queue of their own: a
//! [`Cursor`] is a position in the buffer, so a watcher that falls behind simply reads further
//! back (lossless, in order, batched into one write), and a turn never waits for anyone.
//!
//! Turns of one conversation form a chain: each buffer holds the slot its successor will be
//! placed in, so a watcher still reading turn N finds turn N+1 even if that one has already
//! sealed. The hub itself only keeps the buffer of the turn in flight; a sealed buffer lives on
//! only while some watcher still reads it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use bytes::{BufMut, Bytes, BytesMut};
use tokio::sync::Notify;

use crate::wire::AgentEvent;

/// One event, framed once for every transport.
#[derive(Debug)]
pub struct Frame {
    /// 0-based position of the event in its turn: the `n` of the SSE id `<turnId>:<n>`.
    pub index: u32,
    /// True for `turn-sealed`, the last frame of a turn.
    pub sealed: bool,
    /// The JSON object followed by `\n`.
    pub line: Bytes,
    /// `id: <turnId>:<n>\ndata: <json>\n\n`.
    pub sse: Bytes,
}

impl Frame {
    fn new(turn_id: &str, index: u32, event: &AgentEvent) -> Frame {
        let json = serde_json::to_vec(event).expect("wire types always serialize");
        let mut line = BytesMut::with_capacity(json.len() + 1);
        line.put_slice(&json);
        line.put_u8(b'\n');
        let mut sse = BytesMut::with_capacity(json.len() + turn_id.len() + 24);
        sse.put_slice(b"id: ");
        sse.put_slice(turn_id.as_bytes());
        sse.put_u8(b':');
        sse.put_slice(index.to_string().as_bytes());
        sse.put_slice(b"\ndata: ");
        sse.put_slice(&json);
        sse.put_slice(b"\n\n");
        Frame {
            index,
            sealed: matches!(event, AgentEvent::TurnSealed(_)),
            line: line.freeze(),
            sse: sse.freeze(),
        }
    }

    /// The bare JSON text (for a WebSocket text message).
    pub fn json(&self) -> Bytes {
        self.line.slice(..self.line.len() - 1)
    }

    fn size(&self) -> usize {
        self.line.len() + self.sse.len() + std::mem::size_of::<Frame>()
    }
}

/// Where the next turn of a conversation will appear.
#[derive(Default)]
struct TurnSlot {
    turn: OnceLock<Arc<TurnBuffer>>,
    filled: Notify,
}

#[derive(Default)]
struct BufferState {
    frames: Vec<Arc<Frame>>,
    bytes: usize,
    sealed: bool,
}

/// The replay buffer of one turn: every event from `user-message` on.
pub struct TurnBuffer {
    pub conversation_id: Arc<str>,
    pub turn_id: Arc<str>,
    state: RwLock<BufferState>,
    grown: Notify,
    next: Arc<TurnSlot>,
}

impl TurnBuffer {
    /// Frames the event once, appends it, and wakes every reader waiting at the end.
    /// Returns the event's index in the turn.
    pub fn publish(&self, event: &AgentEvent) -> u32 {
        self.push(event, false)
    }

    fn push(&self, event: &AgentEvent, last: bool) -> u32 {
        let index = {
            let mut st = self.state.write().unwrap_or_else(|p| p.into_inner());
            let index = st.frames.len() as u32;
            let frame = Arc::new(Frame::new(&self.turn_id, index, event));
            st.bytes += frame.size();
            st.frames.push(frame);
            st.sealed = last;
            index
        };
        self.grown.notify_waiters();
        index
    }

    /// Bytes held by the frames of this turn.
    pub fn bytes(&self) -> usize {
        self.state.read().unwrap_or_else(|p| p.into_inner()).bytes
    }

    /// Number of events published so far.
    pub fn len(&self) -> usize {
        self.state
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .frames
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

enum Position {
    /// Reading a turn; `next` is the index of the next frame to hand out.
    Reading {
        buffer: Arc<TurnBuffer>,
        next: usize,
    },
    /// Caught up with every turn so far; waiting for the next one to begin.
    Waiting(Arc<TurnSlot>),
    Done,
}

/// A watcher's position in a conversation's stream of turns.
pub struct Cursor {
    at: Position,
    /// Go on to later turns after `turn-sealed` (a conversation watcher), or stop (one turn).
    follow: bool,
    /// Lets the hub forget an idle conversation once its last watcher leaves.
    release: Option<(Arc<Hub>, Arc<str>)>,
}

impl Cursor {
    /// Waits until at least one frame is available, then returns every available frame up to
    /// `max`. Returns an empty batch when a single-turn cursor has delivered `turn-sealed`.
    pub async fn next_batch(&mut self, max: usize) -> Vec<Arc<Frame>> {
        loop {
            match &mut self.at {
                Position::Done => return Vec::new(),
                Position::Waiting(slot) => {
                    let slot = slot.clone();
                    let filled = slot.filled.notified();
                    tokio::pin!(filled);
                    filled.as_mut().enable();
                    if let Some(buffer) = slot.turn.get() {
                        self.at = Position::Reading {
                            buffer: buffer.clone(),
                            next: 0,
                        };
                        continue;
                    }
                    filled.await;
                }
                Position::Reading { buffer, next } => {
                    let buffer = buffer.clone();
                    let grown = buffer.grown.notified();
                    tokio::pin!(grown);
                    grown.as_mut().enable();
                    let (batch, sealed_end) = {
                        let st = buffer.state.read().unwrap_or_else(|p| p.into_inner());
                        let end = st.frames.len().min(*next + max);
                        let batch: Vec<Arc<Frame>> = st.frames[*next..end].to_vec();
                        (batch, st.sealed && end == st.frames.len())
                    };
                    *next += batch.len();
                    if sealed_end {
                        self.at = if self.follow {
                            Position::Waiting(buffer.next.clone())
                        } else {
                            Position::Done
                        };
                    }
                    if !batch.is_empty() {
                        return batch;
                    }
                    if !sealed_end {
                        grown.await;
                    }
                }
            }
        }
    }

    /// The turn this cursor is reading and the index of the next frame it will hand out.
    pub fn position(&self) -> Option<(Arc<str>, usize)> {
        match &self.at {
            Position::Reading { buffer, next } => Some((buffer.turn_id.clone(), *next)),
            _ => None,
        }
    }
}

impl Drop for Cursor {
    fn drop(&mut self) {
        if let Some((hub, conversation_id)) = self.release.take() {
            self.at = Position::Done;
            hub.forget_if_unwatched(&conversation_id);
        }
    }
}

/// Concatenates a batch of frames into one buffer, so a batch costs one socket write.
pub fn join_frames(frames: &[Arc<Frame>], pick: impl Fn(&Frame) -> &Bytes) -> Bytes {
    match frames {
        [one] => pick(one).clone(),
        many => {
            let len = many.iter().map(|f| pick(f).len()).sum();
            let mut out = BytesMut::with_capacity(len);
            for f in many {
                out.put_slice(pick(f));
            }
            out.freeze()
        }
    }
}

struct Channel {
    current: Option<Arc<TurnBuffer>>,
    next: Arc<TurnSlot>,
}

/// The per-conversation channels. The lock is held only for a few pointer moves, never across
/// an `.await`, so a `std` mutex fits.
#[derive(Default)]
pub struct Hub {
    channels: Mutex<HashMap<Arc<str>, Channel>>,
}

impl Hub {
    pub fn new() -> Arc<Hub> {
        Arc::new(Hub::default())
    }

    /// Opens the replay buffer of a new turn. The caller guarantees one turn at a time per
    /// conversation.
    pub fn begin_turn(&self, conversation_id: &str, turn_id: &str) -> Arc<TurnBuffer> {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        let channel = channels
            .entry(Arc::from(conversation_id))
            .or_insert_with(|| Channel {
                current: None,
                next: Arc::default(),
            });
        let buffer = Arc::new(TurnBuffer {
            conversation_id: Arc::from(conversation_id),
            turn_id: Arc::from(turn_id),
            state: RwLock::default(),
            grown: Notify::new(),
            next: Arc::default(),
        });
        let slot = std::mem::replace(&mut channel.next, buffer.next.clone());
        let _ = slot.turn.set(buffer.clone());
        slot.filled.notify_waiters();
        channel.current = Some(buffer.clone());
        buffer
    }

    /// Publishes `turn-sealed` and drops the hub's hold on the buffer in one step, so a watcher
    /// that subscribes afterwards waits for the next turn instead of replaying a sealed one.
    pub fn seal_turn(&self, buffer: Arc<TurnBuffer>, sealed: &AgentEvent) {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        buffer.push(sealed, true);
        let conversation_id = buffer.conversation_id.clone();
        if let Some(channel) = channels.get_mut(&*conversation_id)
            && channel
                .current
                .as_ref()
                .is_some_and(|c| Arc::ptr_eq(c, &buffer))
        {
            channel.current = None;
        }
        drop(buffer);
        Self::collect(&mut channels, &conversation_id);
    }

    /// Reads one turn alone, from its first event to `turn-sealed`.
    pub fn read_turn(self: &Arc<Self>, buffer: &Arc<TurnBuffer>) -> Cursor {
        Cursor {
            at: Position::Reading {
                buffer: buffer.clone(),
                next: 0,
            },
            follow: false,
            release: Some((self.clone(), buffer.conversation_id.clone())),
        }
    }

    /// Subscribes to a conversation: the in-flight turn from its first event, then every
    /// later turn. Subscribing and publishing are ordered by the buffer's lock, so the
    /// watcher sees no gap and no duplicate.
    pub fn subscribe(self: &Arc<Self>, conversation_id: &str) -> Cursor {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        let key: Arc<str> = Arc::from(conversation_id);
        let channel = channels.entry(key.clone()).or_insert_with(|| Channel {
            current: None,
            next: Arc::default(),
        });
        let at = match &channel.current {
            Some(buffer) => Position::Reading {
                buffer: buffer.clone(),
                next: 0,
            },
            None => Position::Waiting(channel.next.clone()),
        };
        Cursor {
            at,
            follow: true,
            release: Some((self.clone(), key)),
        }
    }

    /// The in-flight turn of a conversation, if any.
    pub fn current(&self, conversation_id: &str) -> Option<Arc<TurnBuffer>> {
        let channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        channels
            .get(conversation_id)
            .and_then(|c| c.current.clone())
    }

    /// Number of conversations the hub holds state for (idle, unwatched ones are forgotten).
    pub fn channel_count(&self) -> usize {
        self.channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    fn forget_if_unwatched(&self, conversation_id: &str) {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        Self::collect(&mut channels, conversation_id);
    }

    /// Drops a channel with no turn in flight whose next slot nobody else can reach: no
    /// watcher waits on it and no buffer a watcher still reads points at it.
    fn collect(channels: &mut HashMap<Arc<str>, Channel>, conversation_id: &str) {
        if let Some(channel) = channels.get(conversation_id)
            && channel.current.is_none()
            && Arc::strong_count(&channel.next) == 1
        {
            channels.remove(conversation_id);
        }
    }
}
