//! The gateway's fan-out core: what carries one turn's events to every watcher, and the bytes
//! they are carried in. It knows the wire's types (`dispatch-wire`) and no other part of the
//! gateway: no store, no runtime, no socket (a transport lends the hub a [`hub::Socket`]).
//!
//! - [`encoding`]: the wire's bytes. An event encoded once for every transport, a batch framed
//!   for one (an HTTP/1.1 chunk of SSE or NDJSON, or WebSocket frames of `chat.delta`).
//! - [`hub`]: replay buffers, cursors, the pacing of rounds, rounds that write to parked
//!   sockets, and the meeting point with other gateways ([`hub::Remote`]).
//!
//! The micro-benchmarks beside it (`benches/`) measure the hot paths alone: publishing and
//! encoding, a round over socket pairs, a batch read under coalescing, the pacing decision.

pub mod encoding;
pub mod hub;

/// The wire's types, as the hub and the encoding take them.
pub use dispatch_wire as wire;
