//! Turning a hub cursor into a response body: batches of pre-framed bytes, one chunk a batch.

use std::convert::Infallible;

use bytes::Bytes;
use futures_util::Stream;

use crate::hub::{Cursor, Frame, join_frames};

/// Most frames joined into one write.
const BATCH: usize = 512;

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
}

/// The body stream of a cursor: ends when the cursor has nothing more to give.
pub fn stream_body(
    cursor: Cursor,
    framing: Framing,
) -> impl Stream<Item = Result<Bytes, Infallible>> + Send {
    futures_util::stream::unfold(cursor, move |mut cursor| async move {
        let batch = cursor.next_batch(BATCH).await;
        if batch.is_empty() {
            return None;
        }
        Some((Ok(join_frames(&batch, framing.pick())), cursor))
    })
}
