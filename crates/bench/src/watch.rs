//! Watchers: the checks of every delivery (order, completeness, latency of stamped events), and
//! the reader threads that serve many subscriptions each over raw epoll.

use crate::*;

/// What one watcher saw: deliveries, order violations, latencies of stamped events.
#[derive(Default)]
pub(crate) struct Seen {
    /// Which node of a cluster the watcher subscribed at (see `Target`).
    pub(crate) group: usize,
    pub(crate) delivered: u64,
    pub(crate) stamped: u64,
    pub(crate) out_of_order: u64,
    pub(crate) latencies: Vec<u64>,
    /// For each latency, in the same order: how much of it the event spent waiting for the
    /// newest event of the read that brought it (that one's send time minus its own). What
    /// is left, the latency minus this, is the time from the newest one's send to the read:
    /// a server that batches shows its batching in the first part, its writing in the second.
    pub(crate) held: Vec<u32>,
    /// The read the last latencies came in (its time) and where its latencies start.
    pub(crate) read: (u64, usize),
    /// The send times of the first stamped events (as many as `watch` was asked to keep).
    pub(crate) early: Vec<u64>,
    pub(crate) sealed: bool,
}

impl Seen {
    /// A stamped event read at `now` with `latency`.
    pub(crate) fn latency(&mut self, now: u64, latency: u64) {
        if now != self.read.0 {
            self.end_read();
            self.read = (now, self.latencies.len());
        }
        self.latencies.push(latency);
    }

    /// The latencies of the last read: each one's wait for the newest (the smallest latency).
    pub(crate) fn end_read(&mut self) {
        let read = &self.latencies[self.read.1..];
        let newest = read.iter().copied().min().unwrap_or(0);
        self.held.extend(read.iter().map(|l| (l - newest).min(u64::from(u32::MAX)) as u32));
        self.read.1 = self.latencies.len();
    }
}

/// A stamped delta's `<micros>:<index>:` prefix.
pub(crate) fn stamp_of(data: &[u8]) -> Option<(u64, u64)> {
    let at = find(data, b"\"delta\":\"")?;
    let mut parts = data[at + 9..].splitn(3, |b| *b == b':');
    Some((number(parts.next()?)?, number(parts.next()?)?))
}

/// The checks of one subscription, message by message: SSE ids without gaps, stamped deltas in
/// index order without gaps, `turn-sealed` (or a peer's last message) at the end.
pub(crate) struct Watcher {
    pub(crate) server: Server,
    pub(crate) transport: Transport,
    pub(crate) events: usize,
    pub(crate) keep: usize,
    pub(crate) seen: Seen,
    pub(crate) last_index: Option<u64>,
}

impl Watcher {
    pub(crate) fn new(server: Server, transport: Transport, events: usize, keep: usize) -> Watcher {
        // Sized and touched now, before the workload's clock starts: grown as events arrive,
        // the lists would be copied a dozen times and fault their pages in while latencies are
        // measured.
        fn touched<T: Copy + Default>(n: usize) -> Vec<T> {
            let mut v = Vec::with_capacity(n);
            v.spare_capacity_mut().fill(std::mem::MaybeUninit::new(T::default()));
            v
        }
        let seen = Seen {
            latencies: touched(events),
            held: touched(events),
            early: touched(keep.min(events)),
            ..Seen::default()
        };
        Watcher { server, transport, events, keep, seen, last_index: None }
    }

    /// Takes one message, read at `now` (unix microseconds); true once the stream is complete.
    pub(crate) fn take(&mut self, message: &[u8], now: u64) -> bool {
        let seen = &mut self.seen;
        let (id, data) = if self.transport == Transport::Sse { fields(message) } else { (None, message) };
        if data.is_empty() || (self.transport == Transport::Ws && find(data, b"\"type\":\"chat.delta\"").is_none()) {
            return false; // a comment, a keep-alive, or a WebSocket message other than an event
        }
        seen.delivered += 1;
        match self.server {
            Server::Gateway => {
                // SSE ids are <turnId>:<n>, n from 0 without gaps.
                if self.transport == Transport::Sse {
                    if id != Some(self.last_index.map_or(0, |l| l + 1)) {
                        seen.out_of_order += 1;
                    }
                    self.last_index = id;
                }
                if let Some((stamp, index)) = stamp_of(data) {
                    if index != seen.stamped {
                        seen.out_of_order += 1;
                    }
                    seen.stamped += 1;
                    seen.latency(now, now.saturating_sub(stamp));
                    if seen.early.len() < self.keep {
                        seen.early.push(stamp);
                    }
                } else if find(data, b"\"type\":\"turn-sealed\"").is_some() {
                    // (A stamped delta is not the seal: most events skip this search.)
                    seen.sealed = true;
                }
            }
            Server::Nchan | Server::Pushpin => {
                // data: <seq>:<stamp>:<padding>
                let mut parts = data.splitn(3, |b| *b == b':');
                let seq = parts.next().and_then(number);
                let stamp = parts.next().and_then(number);
                if seq != Some(self.last_index.map_or(0, |l| l + 1)) {
                    seen.out_of_order += 1;
                }
                self.last_index = seq;
                if let Some(stamp) = stamp {
                    seen.stamped += 1;
                    seen.latency(now, now.saturating_sub(stamp));
                }
                if seq == Some(self.events as u64 - 1) {
                    seen.sealed = true;
                }
            }
        }
        seen.sealed
    }
}

/// Reads many subscriptions until the end of the workload, on as many threads as there are
/// cores, each one epoll loop over its share of the sockets (edge-triggered; a read that
/// returns less than it had room for emptied the socket, so it is not followed by another).
/// The load generator shares the cores with the server, and an async task per subscription
/// (woken, scheduled and polled for every read) cost it 10-15% more CPU in W3; every
/// microsecond it spends is one the server may wait for a core, and shows up in the latencies
/// it measures.
/// `groups`: the feeds were opened at that many nodes in turn (feed i at node i % groups).
pub(crate) fn watch_all(
    server: Server,
    feeds: Vec<Feed>,
    events: usize,
    keep: usize,
    groups: usize,
) -> tokio::task::JoinHandle<Vec<Seen>> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).min(feeds.len()).max(1);
    let mut shares: Vec<Vec<(std::net::TcpStream, Decoder, Watcher)>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, feed) in feeds.into_iter().enumerate() {
        let mut watcher = Watcher::new(server, feed.dec.transport, events, keep);
        watcher.seen.group = i % groups.max(1);
        let stream = feed.stream.into_std().expect("the socket leaves the runtime");
        shares[i % threads].push((stream, feed.dec, watcher));
    }
    let handles: Vec<_> = shares.into_iter().map(|share| std::thread::spawn(move || epoll_watch(share))).collect();
    tokio::task::spawn_blocking(move || handles.into_iter().flat_map(|h| h.join().expect("a reader thread")).collect())
}

/// Seconds of silence on every open subscription of a reader thread after which it stops.
pub(crate) const QUIET_SECONDS: u32 = 10;

/// One thread's loop of [`watch_all`].
pub(crate) fn epoll_watch(mut share: Vec<(std::net::TcpStream, Decoder, Watcher)>) -> Vec<Seen> {
    use std::os::fd::AsRawFd;
    // SAFETY: plain epoll calls on descriptors this thread owns; `events` outlives each wait.
    let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    assert!(epoll >= 0, "epoll_create1: {}", std::io::Error::last_os_error());
    for (i, (stream, _, _)) in share.iter().enumerate() {
        let mut event =
            libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLET) as u32, u64: i as u64 };
        let r = unsafe { libc::epoll_ctl(epoll, libc::EPOLL_CTL_ADD, stream.as_raw_fd(), &mut event) };
        assert_eq!(r, 0, "epoll_ctl: {}", std::io::Error::last_os_error());
    }
    let mut open: Vec<bool> = vec![true; share.len()];
    let mut left = share.len();
    // Serves one socket; at its end, shuts it down as the async reader's drop would (the
    // server sees the watcher go).
    let turn = |i: usize, share: &mut [(std::net::TcpStream, Decoder, Watcher)], open: &mut [bool]| -> bool {
        if open[i] && !serve(&mut share[i]) {
            open[i] = false;
            unsafe { libc::shutdown(share[i].0.as_raw_fd(), libc::SHUT_RDWR) };
            return true;
        }
        false
    };
    // What was read with the response head, and anything already waiting.
    for i in 0..share.len() {
        left -= usize::from(turn(i, &mut share, &mut open));
    }
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
    let mut quiet = 0;
    while left > 0 {
        let n = unsafe { libc::epoll_wait(epoll, events.as_mut_ptr(), events.len() as i32, 1000) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            assert_eq!(e.kind(), std::io::ErrorKind::Interrupted, "epoll_wait: {e}");
            continue;
        }
        // A server that lost a stream's last event never ends it: the watchers still open are
        // given up (and counted incomplete) once none of them heard anything for a while.
        quiet = if n == 0 { quiet + 1 } else { 0 };
        if quiet >= QUIET_SECONDS {
            break;
        }
        for event in &events[..n as usize] {
            left -= usize::from(turn(event.u64 as usize, &mut share, &mut open));
        }
    }
    unsafe { libc::close(epoll) };
    share.into_iter().map(|(_, _, watcher)| watcher.seen).collect()
}

/// Takes everything a socket has: decodes, checks each message, answers pings. False once the
/// stream is complete or gone.
pub(crate) fn serve((stream, dec, watcher): &mut (std::net::TcpStream, Decoder, Watcher)) -> bool {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    // Set by a read that returned less than it had room for: the socket is empty, so after
    // what it brought (and the pongs it asks for) the loop waits for the next edge.
    let mut emptied = false;
    loop {
        while let Some(range) = dec.message() {
            if watcher.take(&dec.body[range], dec.read_at) {
                return false;
            }
        }
        if dec.ended {
            return false;
        }
        if !dec.reply.is_empty() {
            // Pongs, a few bytes each: the socket's buffer takes them.
            let reply = std::mem::take(&mut dec.reply);
            if stream.write_all(&reply).is_err() {
                return false;
            }
        }
        if emptied {
            return true;
        }
        let buf = dec.room();
        let spare = buf.spare_capacity_mut();
        let room = spare.len();
        // SAFETY: `recv` writes at most `room` bytes into the spare capacity, and the length
        // grows by what it wrote.
        let read = unsafe { libc::recv(stream.as_raw_fd(), spare.as_mut_ptr().cast(), room, 0) };
        match read {
            0 => return false,
            n if n > 0 => {
                unsafe { buf.set_len(buf.len() + n as usize) };
                dec.arrived(now_micros());
                emptied = (n as usize) < room;
            }
            _ => match std::io::Error::last_os_error().kind() {
                std::io::ErrorKind::WouldBlock => return true,
                std::io::ErrorKind::Interrupted => {}
                _ => return false,
            },
        }
    }
}
