//! The tests of `parked.rs`.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use futures_util::FutureExt;
use tokio::time::Instant;

use super::*;
use crate::hub::buffer::{BATCH, SHARED_PAST, TurnBuffer, write_round};
use crate::hub::tests::{sealed, text};
use crate::hub::{FlushWindow, Hub};
use crate::wire::{AgentEvent, TurnStartEvent};

impl Socket for UnixStream {
    fn try_write(&self, bytes: &[u8]) -> io::Result<usize> {
        (&*self).write(bytes)
    }
}

/// A turn whose deltas are paced (a 1 ms window: one cursor reads it), so rounds write to
/// parked sinks; the cursor must be kept.
fn paced(cap: usize) -> (Arc<Hub>, Arc<TurnBuffer>, crate::hub::Cursor) {
    let hub = Hub::new(cap, FlushWindow::new(u32::MAX, Duration::from_millis(1)));
    let buffer = hub.begin_turn("c", "t", &[]);
    // Without a bus, subscribing never waits.
    let (reading, _) = hub.subscribe("c", None).now_or_never().expect("no bus to wait for");
    assert!(buffer.paced());
    (hub, buffer, reading)
}

/// Lets a deferred round (at most one window away) run.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(5)).await;
}

/// A parked stream on one end of a socket pair, and the other end to read it from.
fn sink() -> (Arc<ParkedStream>, Arc<UnixStream>, UnixStream, Arc<Deliveries>) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    ours.set_nonblocking(true).unwrap();
    theirs.set_nonblocking(true).unwrap();
    let metrics: Arc<Deliveries> = Arc::default();
    let ours = Arc::new(ours);
    (ParkedStream::new(ours.clone(), Transport::Ndjson, metrics.clone()), ours, theirs, metrics)
}

/// Everything readable now.
fn read_now(from: &mut UnixStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match from.read(&mut buf) {
            Ok(0) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return out,
            Err(e) => panic!("{e}"),
        }
    }
}

/// The data of a run of whole HTTP/1.1 chunks.
fn dechunk(mut bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let eol = bytes.windows(2).position(|w| w == b"\r\n").expect("a size line");
        let size = usize::from_str_radix(std::str::from_utf8(&bytes[..eol]).unwrap(), 16).unwrap();
        let data = &bytes[eol + 2..];
        out.extend_from_slice(&data[..size]);
        assert_eq!(&data[size..size + 2], b"\r\n");
        bytes = &data[size + 2..];
    }
    out
}

fn deltas(lines: &[u8]) -> Vec<String> {
    lines
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice::<serde_json::Value>(l).unwrap()["delta"].as_str().unwrap_or("").to_owned())
        .collect()
}

/// The deltas read until there are `n` of them (a deferred round waits at most a window, or
/// as long as a loaded machine keeps the timer's task waiting), or 2 s have passed.
async fn deltas_until(from: &mut UnixStream, n: usize) -> Vec<String> {
    let mut got = Vec::new();
    for _ in 0..400 {
        got.extend(read_now(from));
        if deltas(&dechunk(&got)).len() >= n {
            break;
        }
        settle().await;
    }
    deltas(&dechunk(&got))
}

async fn handed_back(sink: &ParkedStream) -> bool {
    tokio::time::timeout(Duration::from_secs(1), sink.handed_back()).await.is_ok()
}

#[tokio::test]
async fn a_parked_sink_gets_every_round_in_order_and_is_handed_back_at_the_seal() {
    let (hub, buffer, _reading) = paced(1 << 20);
    let (sink, _ours, mut theirs, metrics) = sink();
    buffer.publish(&text("a"));
    buffer.attach(&sink);
    // Parking writes what was published before.
    sink.park(buffer.as_ref(), 0);
    assert_eq!(metrics.round_writes.load(Relaxed), 1);
    buffer.publish(&text("b"));
    buffer.publish(&text("c"));
    // b and c go at once or with a round the window defers.
    assert_eq!(deltas_until(&mut theirs, 3).await, ["a", "b", "c"]);
    // b went at once or waited for c's round: one write or two.
    assert!((2..=3).contains(&metrics.round_writes.load(Relaxed)));
    assert_eq!(metrics.events.load(Relaxed), 3);
    hub.seal_turn(buffer.clone(), &sealed());
    assert!(handed_back(&sink).await, "turn-sealed hands the sink back");
    let back = sink.unpark();
    assert!(back.sealed && back.sent && !back.failed && back.rest.is_none());
    assert_eq!(back.next, 4);
    assert!(
        dechunk(&read_now(&mut theirs))
            .ends_with(b"\"type\":\"turn-sealed\",\"conversationId\":\"c\",\"turnId\":\"t\"}\n")
    );
    // Unparked: a round writes nothing more.
    write_round(&buffer, None);
    assert!(read_now(&mut theirs).is_empty());
}

#[tokio::test]
async fn a_run_published_together_goes_out_in_one_round() {
    let (_hub, buffer, _reading) = paced(1 << 20);
    let (sink, _ours, mut theirs, metrics) = sink();
    buffer.attach(&sink);
    sink.park(buffer.as_ref(), 0);
    let start = || AgentEvent::TurnStart(TurnStartEvent { conversation_id: "c".into(), turn_id: "t".into() });
    // Events no round holds back, one at a time: a round, and a write, each.
    buffer.publish(&start());
    buffer.publish(&start());
    assert_eq!(metrics.round_writes.load(Relaxed), 2);
    // A run of them (one bus message's worth) published together: one round, one write.
    buffer.publish_all(&[start(), start(), start()]);
    assert_eq!(metrics.round_writes.load(Relaxed), 3);
    assert_eq!(metrics.events.load(Relaxed), 5);
    let lines = dechunk(&read_now(&mut theirs));
    assert_eq!(lines.split(|b| *b == b'\n').filter(|l| !l.is_empty()).count(), 5);
}

#[tokio::test]
async fn a_socket_that_takes_part_of_a_write_hands_the_rest_back_and_nothing_is_written_after_unparking() {
    let (_hub, buffer, _reading) = paced(1 << 30);
    let (sink, ours, mut theirs, metrics) = sink();
    buffer.attach(&sink);
    sink.park(buffer.as_ref(), 0);
    let big = "x".repeat(64 * 1024);
    let mut published = 0;
    while metrics.round_short_writes.load(Relaxed) == 0 {
        buffer.publish(&text(&big));
        settle().await;
        published += 1;
        assert!(published < 1_000, "the socket never filled");
    }
    assert!(handed_back(&sink).await);
    let back = sink.unpark();
    assert_eq!(back.next, published);
    let rest = back.rest.expect("the part the socket did not take");
    // Not parked: later events are not written by rounds.
    buffer.publish(&text("later"));
    settle().await;
    // What the socket took, then the rest, is every event so far in order (the reader
    // drains between writes of the rest).
    let mut got = read_now(&mut theirs);
    let mut rest = &rest[..];
    while !rest.is_empty() {
        if let Ok(n) = (&*ours).write(rest) {
            rest = &rest[n..];
        }
        got.extend(read_now(&mut theirs));
    }
    let got = deltas(&dechunk(&got));
    assert_eq!(got.len(), published as usize);
    assert!(got.iter().all(|d| *d == big));
}

#[tokio::test]
async fn a_capped_batch_or_a_position_coalesced_away_is_handed_back() {
    // More frames than one write takes: the first batch is written, the task does the rest.
    let (_hub, buffer, _reading) = paced(1 << 30);
    for i in 0..(BATCH + 10) {
        buffer.publish(&text(&i.to_string()));
    }
    let (sink, _ours, mut theirs, _) = sink();
    buffer.attach(&sink);
    sink.park(buffer.as_ref(), 0);
    assert!(handed_back(&sink).await);
    assert_eq!(sink.unpark().next, BATCH as u32);
    assert_eq!(deltas(&dechunk(&read_now(&mut theirs))).len(), BATCH);

    // A position inside a coalesced run: nothing is written, the task is told.
    let (_hub, buffer, _reading) = paced(2_000);
    for i in 0..40 {
        buffer.publish(&text(&format!("w{i} ")));
    }
    let (sink, _ours, mut theirs, metrics) = self::sink();
    buffer.attach(&sink);
    sink.park(buffer.as_ref(), 5);
    assert!(handed_back(&sink).await);
    let back = sink.unpark();
    assert_eq!((back.next, back.sent), (5, false));
    assert!(read_now(&mut theirs).is_empty());
    assert_eq!(metrics.round_writes.load(Relaxed), 0);
}

#[tokio::test]
async fn a_round_of_another_turn_does_not_write_to_a_sink_parked_on_this_one() {
    let (_hub, earlier, _reading) = paced(1 << 20);
    let (_hub2, later, _reading2) = paced(1 << 20);
    let (sink, _ours, mut theirs, metrics) = sink();
    // Still in the earlier turn's list (a round's copy of it), parked on the later turn.
    earlier.attach(&sink);
    later.attach(&sink);
    sink.park(later.as_ref(), 0);
    earlier.publish(&text("from the earlier turn"));
    settle().await;
    write_round(&earlier, None);
    assert!(read_now(&mut theirs).is_empty());
    later.publish(&text("b"));
    assert_eq!(deltas_until(&mut theirs, 1).await, ["b"]);
    assert_eq!(metrics.round_writes.load(Relaxed), 1);
}

#[tokio::test]
async fn with_the_window_closed_a_round_hands_parked_sinks_back_instead_of_writing() {
    let hub = Hub::new(1 << 20, FlushWindow::new(0, Duration::ZERO));
    let buffer = hub.begin_turn("c", "t", &[]);
    assert!(!buffer.paced());
    let (sink, _ours, mut theirs, metrics) = sink();
    buffer.attach(&sink);
    sink.park(buffer.as_ref(), 0);
    buffer.publish(&text("a"));
    assert!(handed_back(&sink).await);
    let back = sink.unpark();
    assert_eq!((back.next, back.sent), (0, false));
    assert!(read_now(&mut theirs).is_empty());
    assert_eq!(metrics.round_writes.load(Relaxed), 0);
}

#[tokio::test(start_paused = true)]
async fn with_the_window_closed_deltas_that_come_apart_are_written_by_the_rounds_and_a_burst_by_the_tasks() {
    let hub = Hub::new(1 << 20, FlushWindow::new(0, Duration::ZERO));
    let buffer = hub.begin_turn("c", "t", &[]);
    let (sink, _ours, mut theirs, metrics) = sink();
    buffer.attach(&sink);
    // Deltas 5 ms apart: from the second one the turn knows its spacing, and is paced.
    buffer.publish(&text("a"));
    tokio::time::advance(Duration::from_millis(5)).await;
    buffer.publish(&text("b"));
    assert!(buffer.paced());
    sink.park(buffer.as_ref(), 2);
    for delta in ["c", "d", "e"] {
        tokio::time::advance(Duration::from_millis(5)).await;
        buffer.publish(&text(delta));
        // The round runs once the publisher yields.
        tokio::task::yield_now().await;
    }
    // A round per delta, each written at once.
    assert_eq!(deltas(&dechunk(&read_now(&mut theirs))), ["c", "d", "e"]);
    assert_eq!(metrics.round_writes.load(Relaxed), 3);
    // Deltas published together (a burst) share the round that the first one started.
    tokio::time::advance(Duration::from_millis(5)).await;
    for delta in ["f", "g", "h"] {
        buffer.publish(&text(delta));
    }
    tokio::task::yield_now().await;
    assert_eq!(deltas(&dechunk(&read_now(&mut theirs))), ["f", "g", "h"]);
    assert_eq!(metrics.round_writes.load(Relaxed), 4);
    // A long burst brings the spacing under a millisecond: its rounds hand the sink back to
    // its task.
    for _ in 0..20 {
        buffer.publish(&text("i"));
    }
    assert!(!buffer.paced());
    assert!(handed_back(&sink).await);
    assert_eq!(sink.unpark().next, 8, "the round wrote nothing of the long burst");
    assert_eq!(metrics.round_writes.load(Relaxed), 4);
}

/// A socket whose every write takes at least 300 us, as on a machine in a slow stretch.
struct Dear(UnixStream);

impl Socket for Dear {
    fn try_write(&self, bytes: &[u8]) -> io::Result<usize> {
        std::thread::sleep(Duration::from_micros(300));
        (&self.0).write(bytes)
    }
}

#[tokio::test]
async fn the_rounds_measure_what_a_write_costs_and_dearer_writes_widen_the_window() {
    // 1,000 sweeps on this test's one worker: 4 ms for one watcher while no round has
    // measured a write (4 us each until then).
    let hub = Hub::new(1 << 20, FlushWindow::new(1_000, Duration::from_secs(3600)));
    let buffer = hub.begin_turn("c", "t", &[]);
    let (_reading, _) = hub.subscribe("c", None).now_or_never().expect("no bus to wait for");
    assert_eq!(buffer.window(), Duration::from_millis(4));
    let mut theirs = Vec::new();
    let mut sinks = Vec::new();
    for _ in 0..64 {
        let (ours, other) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        other.set_nonblocking(true).unwrap();
        let sink = ParkedStream::new(Arc::new(Dear(ours)), Transport::Ndjson, Arc::default());
        buffer.attach(&sink);
        sink.park(buffer.as_ref(), 0);
        sinks.push(sink);
        theirs.push(other);
    }
    // Twenty rounds of everyone (events that are not deltas go at once), each writing to
    // the 64 sockets at 300 us or more a write: each moves the average 1/64 of the way (a
    // quarter of it in all).
    let start = AgentEvent::TurnStart(TurnStartEvent { conversation_id: "c".into(), turn_id: "t".into() });
    for _ in 0..20 {
        buffer.publish(&start);
    }
    for other in &mut theirs {
        let lines = dechunk(&read_now(other)).iter().filter(|b| **b == b'\n').count();
        assert_eq!(lines, 20, "every round wrote to every socket");
    }
    assert!(hub.write_cost() >= Duration::from_micros(60), "{:?}", hub.write_cost());
    assert!(buffer.window() >= Duration::from_millis(60), "{:?}", buffer.window());
}

/// The window of [`parked_sinks`].
const WINDOW: Duration = Duration::from_millis(15);

/// A turn whose deltas are paced under a 15 ms window (one cursor, kept, reads it), with `n`
/// sinks parked at its start, and the other ends of their sockets to read them from.
#[allow(clippy::type_complexity)]
fn parked_sinks(
    n: usize,
) -> (
    Arc<Hub>,
    Arc<TurnBuffer>,
    crate::hub::Cursor,
    Vec<(Arc<ParkedStream>, Arc<UnixStream>, UnixStream, Arc<Deliveries>)>,
    Vec<UnixStream>,
) {
    let hub = Hub::new(1 << 20, FlushWindow::new(u32::MAX, WINDOW));
    let buffer = hub.begin_turn("c", "t", &[]);
    // Without a bus, subscribing never waits.
    let (reading, _) = hub.subscribe("c", None).now_or_never().expect("no bus to wait for");
    let sinks: Vec<_> = (0..n).map(|_| sink()).collect();
    for (sink, ..) in &sinks {
        buffer.attach(sink);
        sink.park(buffer.as_ref(), 0);
    }
    let theirs = sinks.iter().map(|(_, _, theirs, _)| theirs.try_clone().unwrap()).collect();
    (hub, buffer, reading, sinks, theirs)
}

#[tokio::test(start_paused = true)]
async fn evenly_spaced_deltas_write_one_phase_of_the_sinks_each_with_a_full_share() {
    // Deltas 5 ms apart under a 15 ms window: a share of 3 deltas per write.
    let (hub, buffer, _reading, sinks, mut theirs) = parked_sinks(6);
    let start = AgentEvent::TurnStart(TurnStartEvent { conversation_id: "c".into(), turn_id: "t".into() });
    buffer.publish(&start);
    let mut got: Vec<Vec<u8>> = theirs.iter_mut().map(read_now).collect();
    assert!(got.iter().all(|g| !g.is_empty()), "anything but a delta goes to everyone at once");
    // Per delta: how many deltas each sink was written.
    let mut writes: Vec<Vec<usize>> = Vec::new();
    for i in 0..30 {
        buffer.publish(&text(&i.to_string()));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let now: Vec<Vec<u8>> = theirs.iter_mut().map(read_now).collect();
        writes.push(now.iter().map(|bytes| deltas(&dechunk(bytes)).len()).collect());
        for (all, new) in got.iter_mut().zip(now) {
            all.extend(new);
        }
        tokio::time::advance(Duration::from_millis(5)).await;
    }
    // Once the spacing is known, each delta writes to a third of the sinks, three deltas each:
    // the rounds are spread over the deltas instead of all six sockets every third delta.
    for (i, per_sink) in writes.iter().enumerate().skip(4) {
        let written: Vec<usize> = per_sink.iter().copied().filter(|n| *n > 0).collect();
        assert_eq!(written, [3, 3], "delta {i}: {writes:?}");
    }
    // The deltas stop (the last one 5 ms ago): what two phases have not been sent goes out
    // with a round of everyone a window and half a spacing after the oldest of it.
    let want: Vec<String> = (0..30).map(|i| i.to_string()).collect();
    let complete = |got: &[Vec<u8>]| {
        got.iter().filter(|all| deltas(&dechunk(all)).into_iter().filter(|d| !d.is_empty()).eq(want.clone())).count()
    };
    for (advance, complete_then) in [(7, 2), (1, 6)] {
        tokio::time::advance(Duration::from_millis(advance)).await;
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        for (all, new) in got.iter_mut().zip(theirs.iter_mut().map(read_now)) {
            all.extend(new);
        }
        assert_eq!(complete(&got), complete_then, "every delta, in order, once, at the deadline");
    }
    hub.seal_turn(buffer.clone(), &sealed());
    for (sink, ..) in &sinks {
        assert!(handed_back(sink).await);
    }
    for (_, _, _, metrics) in &sinks {
        assert!(metrics.round_writes.load(Relaxed) <= 14, "about one write per share");
    }
}

#[tokio::test(start_paused = true)]
async fn with_irregular_spacing_every_delta_arrives_once_in_order_within_the_window_and_half_a_spacing() {
    let (_hub, buffer, _reading, sinks, mut theirs) = parked_sinks(7);
    let window = WINDOW;
    // Per sink, the deltas it got and when.
    let mut got: Vec<Vec<(usize, Instant)>> = vec![Vec::new(); sinks.len()];
    let read = |theirs: &mut [UnixStream], got: &mut [Vec<(usize, Instant)>]| {
        for (from, got) in theirs.iter_mut().zip(got.iter_mut()) {
            for delta in deltas(&dechunk(&read_now(from))) {
                got.push((delta.parse().unwrap(), Instant::now()));
            }
        }
    };
    let settle = || async {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    };
    // Runs of 20 deltas, 0 to 3 ms apart and 8 to 12 ms apart in turn (a fixed pseudo-random
    // sequence): the share moves between 2 and every delta at once, the phases are laid out
    // again and again, and a share learnt from short gaps must not hold deltas that come
    // slower (the timer ends their wait).
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut published = Vec::new();
    for i in 0..300 {
        buffer.publish(&text(&i.to_string()));
        published.push(Instant::now());
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let gap = if i / 20 % 2 == 0 { x % 4 } else { 8 + x % 5 };
        for _ in 0..=gap {
            settle().await;
            read(&mut theirs, &mut got);
            tokio::time::advance(Duration::from_millis(1)).await;
        }
    }
    for _ in 0..40 {
        settle().await;
        read(&mut theirs, &mut got);
        tokio::time::advance(Duration::from_millis(1)).await;
    }
    // The slack is half the spacing (at most 6 ms here); the reads are 1 ms apart, and a
    // timer fires on the millisecond after its deadline.
    let bound = window + Duration::from_millis(6 + 2);
    for got in &got {
        assert_eq!(got.iter().map(|(i, _)| *i).collect::<Vec<_>>(), (0..300).collect::<Vec<_>>());
        for (i, at) in got {
            assert!(*at - published[*i] <= bound, "delta {i} waited {:?}", *at - published[*i]);
        }
    }
    let writes: u64 = sinks.iter().map(|(_, _, _, metrics)| metrics.round_writes.load(Relaxed)).sum();
    assert!(writes < 7 * 300 * 3 / 4, "deltas share writes: {writes}");
}

/// The threads that wrote to a set of sockets, and when the first write was.
#[derive(Default)]
struct Writers {
    threads: Mutex<(std::collections::HashSet<std::thread::ThreadId>, Option<std::time::Instant>)>,
    another: std::sync::Condvar,
}

/// A socket that notes which thread wrote to it. Until a second thread has written (or 2 s
/// from the first write), a write waits for one: a round's part then is still writing when
/// the other worker could take the other part, however slowly a loaded machine schedules it.
struct Noted {
    inner: UnixStream,
    writers: Arc<Writers>,
}

impl Socket for Noted {
    fn try_write(&self, bytes: &[u8]) -> io::Result<usize> {
        let mut seen = self.writers.threads.lock().unwrap();
        seen.0.insert(std::thread::current().id());
        self.writers.another.notify_all();
        let deadline = *seen.1.get_or_insert_with(|| std::time::Instant::now() + Duration::from_secs(2));
        while seen.0.len() < 2 {
            let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) else { break };
            seen = self.writers.another.wait_timeout(seen, left).unwrap().0;
        }
        drop(seen);
        (&self.inner).write(bytes)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_of_many_streams_is_written_from_both_workers() {
    let (_hub, buffer, _reading) = paced(1 << 20);
    let writers = Arc::new(Writers::default());
    let mut ends = Vec::new();
    for _ in 0..4 * SHARED_PAST {
        let (ours, theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        theirs.set_nonblocking(true).unwrap();
        let socket = Arc::new(Noted { inner: ours, writers: writers.clone() });
        let sink = ParkedStream::new(socket, Transport::Ndjson, Arc::default());
        buffer.attach(&sink);
        sink.park(buffer.as_ref(), 0);
        ends.push((sink, theirs));
    }
    // Published from a task, as a turn publishes: the round starts on a worker.
    let publisher = buffer.clone();
    tokio::spawn(async move { publisher.publish(&text("a")) }).await.unwrap();
    let wrote = |ends: &mut Vec<(Arc<ParkedStream>, UnixStream)>| {
        ends.iter_mut().map(|(_, theirs)| read_now(theirs)).filter(|got| !got.is_empty()).count()
    };
    let mut written = 0;
    for _ in 0..800 {
        written += wrote(&mut ends);
        if written == ends.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(written, ends.len());
    assert_eq!(writers.threads.lock().unwrap().0.len(), 2, "the round's parts ran on both workers");
}
