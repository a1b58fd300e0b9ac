//! Live streams between the routes that open them and the connections that write them.
//!
//! A route that opens a live stream (an SSE or NDJSON watch, a WebSocket session) answers with
//! the response head and a [`Handoff`]: the stream, set up, for the connection to serve after
//! the head. Routes (`http`) and connections (`net`) both import this module and not each
//! other. What a stream writes and when it ends is decided here ([`Watch::step`], [`Session`]),
//! whichever way the connection writes it.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::http::Extensions;
use axum::response::Response;
use tokio_util::sync::CancellationToken;

mod reading;
mod session;
mod subscriptions;
mod watch;

pub use reading::{Budgeted, Reading, ReadingBudget};
pub use session::{Ops, Session, SessionSetup};
pub use subscriptions::Subscriptions;
pub use watch::{Action, Wake, Watch, WatchSetup, content_type};

/// A live stream, ready to be served.
// A watch, the common case, is kept inline (it is moved once, into its connection's task).
#[allow(clippy::large_enum_variant)]
pub enum Live {
    /// An SSE or NDJSON watcher: the body of a `200`.
    Watch(Watch),
    /// A WebSocket session: what follows a `101`. Boxed: a session's state is several times a
    /// watch's, and every connection's task would otherwise hold that much, idle watchers
    /// included.
    Session(Box<Session>),
}

/// The live stream a route hands to the connection under it, in its response's extensions (the
/// one way from a handler to the connection). Whoever serves the response takes it out once: a
/// connection that writes its responses itself serves it on the socket; hyper's serves a watch
/// as the response's body and a session on the socket hyper hands back after the `101`.
#[derive(Clone)]
pub struct Handoff(Arc<Mutex<Option<Live>>>);

impl Handoff {
    /// Puts `live` into `response` (whose body is then unused).
    pub fn attach(response: &mut Response, live: Live) {
        response.extensions_mut().insert(Handoff(Arc::new(Mutex::new(Some(live)))));
    }

    /// The live stream a response carries, taken out (`None` for any other response, or once
    /// taken).
    pub fn take(extensions: &Extensions) -> Option<Live> {
        extensions.get::<Handoff>()?.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// Resolves when a token is cancelled, for futures polled on every wake of a busy task (a
/// connection, a live stream): polling the token's own future takes a lock each time, so it is
/// polled only after it has woken the task itself, which it does through a waker that raises a
/// flag on the way. Every other poll is an atomic swap.
pub struct Cancelled {
    wait: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
    flag: std::sync::Arc<FlagWaker>,
    waker: std::task::Waker,
    polled: bool,
}

/// Raises `fired`, then wakes the task last registered.
struct FlagWaker {
    fired: std::sync::atomic::AtomicBool,
    task: futures_util::task::AtomicWaker,
}

impl std::task::Wake for FlagWaker {
    fn wake(self: std::sync::Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &std::sync::Arc<Self>) {
        self.fired.store(true, std::sync::atomic::Ordering::Release);
        self.task.wake();
    }
}

impl Cancelled {
    pub fn new(token: &CancellationToken) -> Cancelled {
        let flag = std::sync::Arc::new(FlagWaker { fired: false.into(), task: Default::default() });
        let waker = std::task::Waker::from(flag.clone());
        Cancelled { wait: Box::pin(token.clone().cancelled_owned()), flag, waker, polled: false }
    }
}

impl Future for Cancelled {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        this.flag.task.register(cx.waker());
        if this.polled && !this.flag.fired.load(std::sync::atomic::Ordering::Acquire) {
            return Poll::Pending;
        }
        this.polled = true;
        this.flag.fired.store(false, std::sync::atomic::Ordering::Relaxed);
        let ready = this.wait.as_mut().poll(&mut Context::from_waker(&this.waker));
        if ready.is_ready() {
            // Cancelled for good: every later poll is ready too.
            this.flag.fired.store(true, std::sync::atomic::Ordering::Release);
        }
        ready
    }
}
