//! W4 (idle streams), W5 (late joiners) and W6 (turns from many clients).

use crate::*;

pub(crate) async fn idle(server: Server, transport: Transport, base: &str, watchers: usize, pids: &[u32]) -> Value {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = rss_kib(pids);
    let mut open = Vec::with_capacity(watchers);
    for i in 0..watchers {
        open.push(subscribe(server, transport.nth(i), base, &format!("idle{}", i % 100)).await);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = rss_kib(pids);
    let per_stream = after.saturating_sub(before) as f64 / watchers as f64;
    drop(open);
    json!({"transport": format!("{transport:?}").to_lowercase(), "watchers": watchers, "rss_before_kib": before,
           "rss_after_kib": after, "kib_per_stream": per_stream, "correct": true})
}

pub(crate) async fn latejoin(
    server: Server,
    transport: Transport,
    base: &str,
    publish_base: &str,
    events: usize,
    rate: u64,
) -> Value {
    if server == Server::Pushpin {
        // Its reliable mode asks the origin for what a subscriber missed: the replay would be
        // the origin's, not Pushpin's.
        eprintln!("latejoin: Pushpin keeps no messages to replay to a late subscriber");
        std::process::exit(2);
    }
    let client = reqwest::Client::new();
    let channel = format!("late{}", now_micros());
    let mut early = subscribe(server, Transport::Sse, base, &channel).await;
    let produced = Arc::new(AtomicU64::new(0));
    let publisher = match server {
        Server::Gateway => {
            start_turn(&client, base, &channel, &format!("latejoin-{events}-{rate}")).await;
            None
        }
        Server::Nchan | Server::Pushpin => {
            let (client, base, channel) = (client.clone(), publish_base.to_owned(), channel.clone());
            Some(tokio::spawn(async move { publish(server, &client, &base, &channel, events, rate).await }))
        }
    };
    let is_event = |server: Server, data: &[u8]| {
        !data.is_empty() && (server != Server::Gateway || find(data, b"\"type\":\"text-delta\"").is_some())
    };
    // Wait until the early watcher holds every event: the turn has emitted them all.
    let mut count = 0;
    while count < events {
        let Some(range) = early.next_message().await else { break };
        if is_event(server, fields(&early.dec.body[range]).1) {
            count += 1;
        }
    }
    produced.store(count as u64, Ordering::Relaxed);
    if let Some(p) = publisher {
        p.await.unwrap();
    }
    let started = Instant::now();
    // Without `until=sealed`: the turn is still open.
    let late_url = match (server, transport) {
        (Server::Gateway, Transport::Ws) => format!("{base}/ws"),
        (Server::Gateway, _) => format!("{base}/conversations/{channel}/events"),
        (Server::Nchan | Server::Pushpin, _) => format!("{base}/sub/{channel}"),
    };
    let mut late = Feed::open(transport, &late_url, &channel).await.expect("subscribes");
    let mut got = 0;
    while got < events {
        let Some(range) = late.next_message().await else { break };
        let message = &late.dec.body[range];
        let data = if transport == Transport::Sse { fields(message).1 } else { message };
        if is_event(server, data) {
            got += 1;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    if server == Server::Gateway {
        let _ = client.post(format!("{base}/conversations/{channel}/stop")).send().await;
    }
    json!({"transport": format!("{transport:?}").to_lowercase(), "events": events, "rate": rate,
           "emitted": produced.load(Ordering::Relaxed), "received": got, "seconds": seconds, "correct": got == events})
}

pub(crate) async fn turns(base: &str, clients: usize, seconds: f64, pids: &[u32]) -> Value {
    let client = authorized_client();
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let writes0 = metric(&client, base, "dispatch_sqlite_write_seconds_count").await.unwrap_or(0.0);
    let cpu0 = cpu_micros(pids);
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (client, base) = (client.clone(), base.to_owned());
            tokio::spawn(async move {
                let (mut sealed, mut bad, mut gaps) = (0u64, 0u64, Vec::new());
                let conversation = format!("turns{c}-{}", now_micros());
                while Instant::now() < deadline {
                    let r = client
                        .post(format!("{base}/chat"))
                        .json(&json!({"conversationId": conversation, "message": "turn-w6"}))
                        .send()
                        .await
                        .unwrap();
                    let mut body = r.bytes_stream();
                    let (mut buf, mut done_at, mut ok) = (Vec::new(), None, false);
                    while let Some(Ok(b)) = body.next().await {
                        let now = Instant::now();
                        buf.extend_from_slice(&b);
                        let mut at = 0;
                        while let Some(end) = find(&buf[at..], b"\n") {
                            let line = &buf[at..at + end];
                            at += end + 1;
                            if find(line, b"\"type\":\"done\"").is_some() {
                                done_at = Some(now);
                            } else if find(line, b"\"type\":\"turn-sealed\"").is_some() {
                                ok = done_at.is_some();
                                if let Some(d) = done_at {
                                    gaps.push(now.duration_since(d).as_micros() as u64);
                                }
                            }
                        }
                        buf.drain(..at);
                    }
                    if ok { sealed += 1 } else { bad += 1 }
                }
                (sealed, bad, gaps)
            })
        })
        .collect();
    let (mut sealed, mut bad, mut gaps) = (0, 0, Vec::new());
    for t in tasks {
        let (s, b, g) = t.await.unwrap();
        sealed += s;
        bad += b;
        gaps.extend(g);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let writes = metric(&client, base, "dispatch_sqlite_write_seconds_count").await.unwrap_or(0.0) - writes0;
    gaps.sort_unstable();
    json!({
        "clients": clients,
        "write_transactions_per_turn": writes / sealed.max(1) as f64,
        "sealed": sealed,
        "seconds": elapsed,
        "turns_per_second": sealed as f64 / elapsed,
        "done_to_sealed_p50_ms": percentile(&gaps, 0.5) as f64 / 1000.0,
        "done_to_sealed_p99_ms": percentile(&gaps, 0.99) as f64 / 1000.0,
        "server_cpu_seconds": cpu_micros(pids).saturating_sub(cpu0) as f64 / 1e6,
        "correct": bad == 0 && sealed > 0,
    })
}
