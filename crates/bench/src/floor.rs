//! The write floor: what the machine's loopback writes cost with nothing else in the way, the
//! figure the fan-out workloads are judged against.

use crate::*;

/// The write floor (see [`Workload::WriteFloor`]): writes go out round-robin in millisecond
/// ticks (as a server's rounds spread over time), each one `write` call on a non-blocking socket;
/// the readers count every byte, and the run is correct only if they got all of them.
pub(crate) async fn write_floor(connections: usize, rate: u64, bytes: usize, seconds: f64) -> Value {
    use std::io::Write;
    use tokio::io::AsyncReadExt;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let address = listener.local_addr().expect("its address");
    let sender = std::thread::spawn(move || {
        let mut sockets = Vec::with_capacity(connections);
        for _ in 0..connections {
            let (socket, _) = listener.accept().expect("a reader connects");
            socket.set_nodelay(true).expect("nodelay");
            socket.set_nonblocking(true).expect("non-blocking");
            sockets.push(socket);
        }
        let payload = vec![b'x'; bytes];
        let per_tick = connections as f64 * rate as f64 / 1000.0;
        let ticks = (seconds * 1000.0) as u32;
        let (mut writes, mut sent, mut would_block, mut due, mut next) = (0u64, 0u64, 0u64, 0.0, 0);
        let (user0, sys0) = thread_cpu_micros();
        let process0 = cpu_micros(&[std::process::id()]);
        let host0 = Host::read();
        let started = Instant::now();
        for tick in 1..=ticks {
            due += per_tick;
            while due >= 1.0 {
                due -= 1.0;
                match sockets[next].write(&payload) {
                    Ok(n) => {
                        writes += 1;
                        sent += n as u64;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => would_block += 1,
                    Err(e) => panic!("write: {e}"),
                }
                next = (next + 1) % sockets.len();
            }
            if let Some(wait) = (started + Duration::from_millis(tick.into())).checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        let elapsed = started.elapsed().as_secs_f64();
        let (user1, sys1) = thread_cpu_micros();
        let process = cpu_micros(&[std::process::id()]) - process0;
        let readers_cpu = process.saturating_sub((user1 - user0) + (sys1 - sys0));
        let host = Host::read().since(host0);
        (writes, sent, would_block, elapsed, user1 - user0, sys1 - sys0, readers_cpu, host)
    });
    let received = Arc::new(AtomicU64::new(0));
    let mut readers = Vec::with_capacity(connections);
    for _ in 0..connections {
        let mut socket = tokio::net::TcpStream::connect(address).await.expect("connects");
        let received = received.clone();
        readers.push(tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            while let Ok(n @ 1..) = socket.read(&mut buf).await {
                received.fetch_add(n as u64, Ordering::Relaxed);
            }
        }));
    }
    let (writes, sent, would_block, elapsed, user, sys, readers_cpu, host) =
        tokio::task::spawn_blocking(move || sender.join().expect("the sender runs")).await.expect("joins");
    for reader in readers {
        reader.await.expect("a reader ends");
    }
    let per_write = |us: u64| us as f64 / writes.max(1) as f64;
    json!({
        "connections": connections,
        "rate": rate,
        "bytes_per_write": bytes,
        "seconds": elapsed,
        "writes": writes,
        "writes_per_second": writes as f64 / elapsed,
        "would_block": would_block,
        "sender_user_us_per_write": per_write(user),
        "sender_sys_us_per_write": per_write(sys),
        "sender_cpu_us_per_write": per_write(user + sys),
        "sender_cores": (user + sys) as f64 / 1e6 / elapsed,
        // The receiving side's reads (each also sends the window update the sender's side
        // processes): the rest of this process's CPU over the same interval.
        "readers_cpu_us_per_write": per_write(readers_cpu),
        "readers_cores": readers_cpu as f64 / 1e6 / elapsed,
        "host_steal_share": host.steal_share(),
        "correct": received.load(Ordering::Relaxed) == sent && would_block == 0,
    })
}
