//! W3 (many conversations at once) and the first half of W8 (healthy watchers beside stalled
//! ones).

use crate::*;

/// W3: `conversations` turns at `rate` tokens/s at once, `watchers` on each, turn starts spread
/// over one token interval (independent conversations are not in step).
pub(crate) async fn scale(
    transport: Transport,
    base: &str,
    conversations: usize,
    watchers: usize,
    events: usize,
    rate: u64,
    pids: &[u32],
) -> Value {
    let client = reqwest::Client::new();
    let prefix = format!("scale{}", now_micros());
    let mut feeds = Vec::with_capacity(conversations * watchers);
    for c in 0..conversations {
        for w in 0..watchers {
            feeds.push(
                subscribe(Server::Gateway, transport.nth(c * watchers + w), base, &format!("{prefix}-{c}")).await,
            );
        }
    }
    let watching = watch_all(Server::Gateway, feeds, events, rate as usize, 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = Usage::read(pids);
    let client_before = cpu_micros(&[std::process::id()]);
    let started = Instant::now();
    let started_micros = now_micros();
    // Each start is its own request at its own instant: awaited one after another, the starts
    // queue behind the streams already running and spread over seconds instead of one interval,
    // so the conversations would not all stream at once.
    let spread = Duration::from_secs_f64(1.0 / rate.max(1) as f64 / conversations as f64);
    let starts: Vec<_> = (0..conversations)
        .map(|c| {
            let (client, base) = (client.clone(), base.to_owned());
            let (conversation, message) = (format!("{prefix}-{c}"), format!("paced-{events}-{rate}"));
            let at = started + spread * c as u32;
            tokio::spawn(async move {
                tokio::time::sleep_until(at.into()).await;
                start_turn(&client, &base, &conversation, &message).await;
                started.elapsed()
            })
        })
        .collect();
    let mut starts_took = Duration::ZERO;
    for start in starts {
        starts_took = starts_took.max(start.await.expect("a turn starts"));
    }
    // The first second of each turn apart: the turns' starts fall in it.
    let (mut tally, elapsed, used) = Tally::finish(watching, events, rate as usize, started, before, pids).await;
    let (p99_first_second, p99_after) = tally.split_p99();
    let client_cpu = cpu_micros(&[std::process::id()]) - client_before;
    let cpu = used.cpu_us();
    let mut result = json!({
        "transport": format!("{transport:?}").to_lowercase(),
        // The load generator's own CPU: it reads every delivery on the same cores.
        "client_cores": client_cpu as f64 / 1e6 / elapsed,
        "conversations": conversations,
        "watchers_per_conversation": watchers,
        "events": events,
        "rate": rate,
        "delivered": tally.delivered,
        "seconds": elapsed,
        "turns_started_within_ms": starts_took.as_secs_f64() * 1e3,
        "latency_p50_ms": tally.p(0.50),
        "latency_p99_ms": tally.p(0.99),
        "latency_p99_first_second_ms": p99_first_second,
        "latency_p99_after_first_second_ms": p99_after,
        // The first second again, by when each event was sent (from the first turn's request).
        "first_second_by_send_time": tally.by_send_time(started_micros),
        "server_cores": cpu as f64 / 1e6 / elapsed,
        "server_cpu_us_per_delivery": cpu as f64 / tally.delivered.max(1) as f64,
        "out_of_order": tally.out_of_order,
        "incomplete_watchers": tally.incomplete,
        "correct": tally.correct(),
    });
    merge(&mut result, used.split(tally.delivered));
    merge(&mut result, tally.parts_p99());
    result
}

/// W8, first half: `watchers` healthy watchers of a burst turn, once alone and once beside a
/// watcher that never reads; healthy throughput of both runs and the server's memory growth.
pub(crate) async fn stalled(base: &str, watchers: usize, events: usize, pids: &[u32]) -> Value {
    use tokio::io::AsyncWriteExt;
    let client = reqwest::Client::new();
    // Twelve runs of each, medians compared: one run is a second or two, and single runs
    // differ by 10-20% here with nothing changed (with six of each, the ratio of the medians
    // still moved by +-5% between runs of the workload). The order is alone, beside, beside,
    // alone, ...: the machine's speed drifts during a run, and in this order a steady drift
    // slows both sides alike (in alternating pairs, the side that always runs second would
    // take all of it).
    let mut runs = Vec::new();
    for with_stalled in (0..24).map(|i| matches!(i % 4, 1 | 2)) {
        let channel = format!("stalled{}", now_micros());
        let mut feeds = Vec::with_capacity(watchers);
        for _ in 0..watchers {
            feeds.push(subscribe(Server::Gateway, Transport::Sse, base, &channel).await);
        }
        let watching = watch_all(Server::Gateway, feeds, events, 0, 1);
        // The stalled watcher: asks for the stream, then never reads a byte.
        let stalled = if with_stalled {
            let host = base.strip_prefix("http://").unwrap_or(base);
            let mut socket = tokio::net::TcpStream::connect(host).await.expect("connects");
            let request = format!("GET /conversations/{channel}/events HTTP/1.1\r\nhost: {host}\r\n\r\n");
            socket.write_all(request.as_bytes()).await.unwrap();
            Some(socket)
        } else {
            None
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let rss0 = rss_kib(pids);
        let peak = Arc::new(AtomicU64::new(rss0));
        let sampler = {
            let (peak, pids) = (peak.clone(), pids.to_vec());
            tokio::spawn(async move {
                loop {
                    peak.fetch_max(rss_kib(&pids), Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        };
        let started = Instant::now();
        start_turn(&client, base, &channel, &format!("fanout-{events}-0")).await;
        let tally = Tally::collect(watching, events, 0).await;
        let elapsed = started.elapsed().as_secs_f64();
        sampler.abort();
        // The turn has sealed: what the hub still holds is what the stalled watcher keeps alive.
        let held = metric(&client, base, "dispatch_hub_buffer_bytes").await;
        drop(stalled);
        runs.push(json!({
            "stalled_watcher": with_stalled,
            "deliveries_per_second": tally.delivered as f64 / elapsed,
            "seconds": elapsed,
            "rss_growth_kib": peak.load(Ordering::Relaxed).saturating_sub(rss0),
            "hub_bytes_after_seal": held,
            "correct": tally.correct(),
        }));
    }
    let median = |stalled: bool, key: &str| {
        let mut v: Vec<f64> =
            runs.iter().filter(|r| r["stalled_watcher"] == stalled).filter_map(|r| r[key].as_f64()).collect();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => 0.0,
            n if n % 2 == 0 => (v[n / 2 - 1] + v[n / 2]) / 2.0,
            n => v[n / 2],
        }
    };
    json!({
        "watchers": watchers,
        "events": events,
        "healthy_throughput_ratio": median(true, "deliveries_per_second") / median(false, "deliveries_per_second").max(1.0),
        "rss_growth_alone_kib": median(false, "rss_growth_kib"),
        "hub_bytes_after_seal_alone": median(false, "hub_bytes_after_seal"),
        "hub_bytes_after_seal_beside_stalled": median(true, "hub_bytes_after_seal"),
        "rss_growth_beside_stalled_kib": median(true, "rss_growth_kib"),
        "correct": runs.iter().all(|r| r["correct"] == true),
        "runs": runs,
    })
}
