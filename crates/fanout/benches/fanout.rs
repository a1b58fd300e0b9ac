//! Micro-benchmarks of the fan-out core's hot paths, each alone: what a change to one of them
//! costs, measured in seconds instead of a full `bench/run`.
//!
//! - `publish`: a delta published into a turn nobody watches (encoded once for every
//!   transport, appended), and a batch framed for each transport.
//! - `round`: a delta published to a turn with N parked streams on socket pairs: the round
//!   writes the delta to every socket (the peers are drained outside the timing).
//! - `coalesced`: a watcher reading a whole turn whose deltas were coalesced, batch by batch.
//! - `pacing`: the decision a published delta takes under an open flush window.
//!
//! `cargo bench -p dispatch-fanout` measures; `-- --quick` is the short run CI makes (it checks
//! that each benchmark runs and holds its premise, not its speed).

use std::hint::black_box;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use dispatch_fanout::encoding::{EncodedEvent, Transport};
use dispatch_fanout::hub::{BATCH, Deliveries, Delivery, FlushWindow, Hub, Pacing, ParkedStream, Round, Socket};
use dispatch_fanout::wire::{AgentEvent, TurnSealedEvent, TurnTextDeltaEvent};

/// A token-sized delta, as models stream them.
fn delta(text: &str) -> AgentEvent {
    AgentEvent::TextDelta(TurnTextDeltaEvent {
        conversation_id: "conversation-0001".into(),
        turn_id: "turn-0001".into(),
        delta: text.into(),
    })
}

fn sealed() -> AgentEvent {
    AgentEvent::TurnSealed(TurnSealedEvent { conversation_id: "conversation-0001".into(), turn_id: "turn-0001".into() })
}

fn publish(c: &mut Criterion) {
    let mut group = c.benchmark_group("publish");
    const EVENTS: u64 = 1_000;
    group.throughput(Throughput::Elements(EVENTS));
    // No window: a turn nobody watches runs no round worth the name.
    let hub = Hub::new(usize::MAX, FlushWindow::new(0, Duration::ZERO));
    let event = delta(" token");
    group.bench_function("delta", |b| {
        b.iter_batched(
            || hub.begin_turn("conversation-0001", "turn-0001", &[]),
            |buffer| {
                for _ in 0..EVENTS {
                    black_box(buffer.publish(&event));
                }
                buffer
            },
            criterion::BatchSize::PerIteration,
        )
    });
    group.finish();

    let mut group = c.benchmark_group("frame");
    let events: Vec<Arc<EncodedEvent>> =
        (0..BATCH as u32).map(|i| Arc::new(EncodedEvent::new("turn-0001", i, i, &delta(" token")))).collect();
    group.throughput(Throughput::Elements(events.len() as u64));
    for transport in Transport::ALL {
        group.bench_function(transport.label(), |b| b.iter(|| black_box(transport.frame(&events))));
    }
    group.finish();
}

/// One end of a socket pair, as a transport lends it to the hub.
struct Pair(UnixStream);

impl Socket for Pair {
    fn try_write(&self, bytes: &[u8]) -> io::Result<usize> {
        (&self.0).write(bytes)
    }
}

/// Reads everything waiting on `peer`; how many bytes that was.
fn drain(peer: &mut UnixStream) -> usize {
    let mut buf = [0u8; 64 * 1024];
    let mut total = 0;
    loop {
        match peer.read(&mut buf) {
            Ok(0) => return total,
            Ok(n) => total += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return total,
            Err(e) => panic!("reading a peer: {e}"),
        }
    }
}

fn round(c: &mut Criterion) {
    let mut group = c.benchmark_group("round");
    for streams in [16usize, 256] {
        group.throughput(Throughput::Elements(streams as u64));
        group.bench_with_input(BenchmarkId::from_parameter(streams), &streams, |b, &streams| {
            let hub = Hub::new(usize::MAX, FlushWindow::new(4, Duration::from_millis(15)));
            // Watchers elsewhere open the flush window, so that rounds write to parked streams
            // (outside a runtime no timer can hold a delta: every round is one of everyone).
            hub.set_readers_elsewhere(100_000);
            let buffer = hub.begin_turn("conversation-0001", "turn-0001", &[]);
            let counts = Arc::new(Deliveries::default());
            let mut peers = Vec::new();
            let mut parked = Vec::new();
            for _ in 0..streams {
                let (ours, theirs) = UnixStream::pair().unwrap();
                ours.set_nonblocking(true).unwrap();
                theirs.set_nonblocking(true).unwrap();
                let stream = ParkedStream::new(Arc::new(Pair(ours)), Transport::Sse, counts.clone());
                buffer.attach(&stream);
                stream.park(buffer.as_ref(), 0);
                parked.push(stream);
                peers.push(theirs);
            }
            let event = delta(" token");
            // The premise: a published delta reaches every socket through the round.
            buffer.publish(&event);
            assert!(peers.iter_mut().all(|p| drain(p) > 0), "a round wrote to every parked stream");
            b.iter_custom(|iterations| {
                let mut spent = Duration::ZERO;
                for _ in 0..iterations {
                    let start = Instant::now();
                    buffer.publish(&event);
                    spent += start.elapsed();
                    for peer in &mut peers {
                        drain(peer);
                    }
                }
                spent
            });
            assert!(counts.round_writes.load(std::sync::atomic::Ordering::Relaxed) > streams as u64);
        });
    }
    group.finish();
}

fn coalesced(c: &mut Criterion) {
    let mut group = c.benchmark_group("coalesced");
    // A turn past its 1 MiB cap: its older deltas coalesced into one long event (so a batch's
    // end is found by its bytes, a position by a binary search), a thousand newer ones single.
    let hub = Hub::new(1 << 20, FlushWindow::new(0, Duration::ZERO));
    let buffer = hub.begin_turn("conversation-0001", "turn-0001", &[]);
    let mut published = 0;
    let mut before = 0;
    while buffer.bytes() >= before {
        before = buffer.bytes();
        buffer.publish(&delta(&format!(" token{published}")));
        published += 1;
    }
    for _ in 0..1_000 {
        buffer.publish(&delta(&format!(" token{published}")));
        published += 1;
    }
    hub.seal_turn(buffer.clone(), &sealed());
    let read = |buffer| {
        let mut cursor = hub.read_turn(buffer);
        let mut batches = 0;
        loop {
            match cursor.try_batch(BATCH) {
                Some(Delivery::Events(events)) => {
                    black_box(events);
                    batches += 1;
                }
                Some(Delivery::End) => return batches,
                other => panic!("a sealed turn reads to its end: {other:?}"),
            }
        }
    };
    // The premise: the buffer did coalesce (a read takes fewer batches than single deltas
    // would), and more than the coalesced event is left to read.
    let batches = read(&buffer);
    assert!((1_000 / BATCH..published / BATCH).contains(&batches), "{batches} batches of {published} deltas");
    group.throughput(Throughput::Elements(published as u64));
    group.bench_function("read", |b| b.iter(|| read(&buffer)));
    group.finish();
}

fn pacing(c: &mut Criterion) {
    let mut group = c.benchmark_group("pacing");
    const DELTAS: u32 = 1_000;
    group.throughput(Throughput::Elements(u64::from(DELTAS)));
    let window = Duration::from_millis(4);
    // Deltas 100 us apart under a 4 ms window: held, phase rounds and rounds of everyone.
    let start = tokio::time::Instant::now();
    let decide = || {
        let mut pacing = Pacing::default();
        let mut rounds = [0u32; 3];
        for i in 0..DELTAS {
            let now = start + Duration::from_micros(100 * u64::from(i));
            let decision = pacing.decide(now, window, true);
            rounds[match decision.round {
                Round::Everyone => 0,
                Round::Phases { .. } => 1,
                Round::Held => 2,
            }] += 1;
        }
        rounds
    };
    let rounds = decide();
    assert!(rounds[0] > 0 && rounds[0] < DELTAS, "the window holds deltas back: {rounds:?}");
    group.bench_function("delta", |b| b.iter(|| black_box(decide())));
    let flush = FlushWindow::new(4, Duration::from_millis(15));
    group.throughput(Throughput::Elements(1));
    group.bench_function("window", |b| b.iter(|| black_box(flush.for_readers(black_box(5_000)))));
    group.finish();
}

criterion_group!(benches, publish, round, coalesced, pacing);
criterion_main!(benches);
