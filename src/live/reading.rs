//! The reading budget: bytes of request bodies and WebSocket messages the gateway holds while it
//! reads them, over every connection (`--max-reading-bytes`). Without it the ceiling is every
//! connection times the body limit: a few hundred clients that each send all but the last byte
//! of a large body hold gigabytes. Routes (`http`) take room for a body before reading it;
//! WebSocket sessions (`net`) for a message while it is assembled.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The gateway's room for bytes being read.
#[derive(Clone)]
pub struct ReadingBudget {
    bytes: Arc<Semaphore>,
    max: usize,
}

/// Room for bytes being read, given back when dropped.
#[derive(Debug)]
pub struct Reading(OwnedSemaphorePermit);

impl Reading {
    /// Bytes of room held.
    pub fn bytes(&self) -> usize {
        self.0.num_permits()
    }

    /// Joins `more` into this one.
    pub fn merge(&mut self, more: Reading) {
        self.0.merge(more.0);
    }
}

impl ReadingBudget {
    pub fn new(max: usize) -> ReadingBudget {
        let max = max.clamp(1, u32::MAX as usize);
        ReadingBudget { bytes: Arc::new(Semaphore::new(max)), max }
    }

    /// Room for `bytes` more (at least one, at most the whole budget), or `None` when the
    /// budget is spent: the caller refuses rather than waits, so a crowd of slow senders cannot
    /// queue everyone else behind them.
    pub fn try_take(&self, bytes: usize) -> Option<Reading> {
        let n = bytes.clamp(1, self.max) as u32;
        self.bytes.clone().try_acquire_many_owned(n).ok().map(Reading)
    }

    /// Bytes being read now.
    pub fn in_use(&self) -> usize {
        self.max - self.bytes.available_permits()
    }
}

/// A request body that holds its room in the budget until it has been read to its end, or
/// dropped unread.
pub struct Budgeted<B> {
    inner: B,
    reading: Option<Reading>,
}

impl<B> Budgeted<B> {
    pub fn new(inner: B, reading: Reading) -> Budgeted<B> {
        Budgeted { inner, reading: Some(reading) }
    }
}

impl<B> http_body::Body for Budgeted<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
            self.reading = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_is_taken_up_to_the_budget_and_given_back() {
        let budget = ReadingBudget::new(1000);
        let a = budget.try_take(600).unwrap();
        assert!(budget.try_take(500).is_none(), "past the budget");
        let b = budget.try_take(400).unwrap();
        assert_eq!(budget.in_use(), 1000);
        drop(a);
        assert_eq!(budget.in_use(), 400);
        drop(b);
        assert_eq!(budget.in_use(), 0);
        let all = budget.try_take(5000).expect("a take larger than the budget takes all of it");
        assert_eq!((all.bytes(), budget.in_use()), (1000, 1000));
    }
}
