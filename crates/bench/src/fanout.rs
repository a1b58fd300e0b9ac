//! The fan-out workloads (W1, W2, W4's streams, the peers): publishing or a turn at a rate,
//! watchers wherever the target says, and the tally of what they saw.

use crate::*;

/// Publishes `events` messages of about 120 bytes (`<seq>:<send time>:<padding>`) to a peer's
/// channel at `rate` per second, each after the previous one was accepted (the only way to keep
/// them in order): to Nchan's publisher location, or as an `http-stream` item (an SSE event) to
/// Pushpin's control API.
pub(crate) async fn publish(
    server: Server,
    client: &reqwest::Client,
    publish: &str,
    channel: &str,
    events: usize,
    rate: u64,
) {
    let start = Instant::now();
    let padding = "x".repeat(90);
    for seq in 0..events {
        if rate > 0 {
            let due = start + Duration::from_secs_f64(seq as f64 / rate as f64);
            tokio::time::sleep_until(due.into()).await;
        }
        let message = format!("{seq}:{}:{padding}", now_micros());
        let request = match server {
            Server::Pushpin => client.post(format!("{publish}/publish/")).json(&json!({"items": [{
                "channel": channel,
                "formats": {"http-stream": {"content": format!("data: {message}\n\n")}},
            }]})),
            _ => client.post(format!("{publish}/pub/{channel}")).body(message),
        };
        let _ = request.send().await;
    }
}

pub(crate) async fn start_turn(client: &reqwest::Client, base: &str, conversation: &str, message: &str) {
    let r = client
        .post(format!("{base}/conversations/{conversation}/messages"))
        .json(&json!({"message": message}))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(r.status(), 202, "starting the turn");
}

/// Every watcher's [`Seen`], summed.
#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) watchers: u64,
    pub(crate) delivered: u64,
    pub(crate) out_of_order: u64,
    pub(crate) incomplete: u64,
    pub(crate) latencies: Vec<u64>,
    /// Each latency's two parts (see `Seen::held`): the wait for the newest event of its read,
    /// and the time from that one's send to the read.
    pub(crate) held: Vec<u32>,
    pub(crate) since_newest: Vec<u32>,
    /// Send time and latency of the events each watcher kept the send time of (see `watch`).
    pub(crate) early: Vec<(u64, u64)>,
    /// With a split asked for (`head` > 0): the latencies of each watcher's first `head`
    /// events, and of the rest.
    pub(crate) split: Option<(usize, Vec<u64>, Vec<u64>)>,
    /// Deliveries and latencies per node, when watchers were spread over several.
    pub(crate) by_group: Vec<(u64, Vec<u64>)>,
}

impl Tally {
    pub(crate) async fn collect(watching: tokio::task::JoinHandle<Vec<Seen>>, events: usize, head: usize) -> Tally {
        let mut tally = Tally { split: (head > 0).then(|| (head, Vec::new(), Vec::new())), ..Tally::default() };
        let seen_all = watching.await.expect("the readers end");
        let groups = seen_all.iter().map(|s| s.group + 1).max().unwrap_or(1);
        if groups > 1 {
            tally.by_group = vec![(0, Vec::new()); groups];
        }
        for mut seen in seen_all {
            seen.end_read();
            let since =
                seen.latencies.iter().zip(&seen.held).map(|(l, h)| (l - u64::from(*h)).min(u32::MAX.into()) as u32);
            tally.since_newest.extend(since);
            tally.held.extend_from_slice(&seen.held);
            if let Some((delivered, latencies)) = tally.by_group.get_mut(seen.group) {
                *delivered += seen.delivered;
                latencies.extend_from_slice(&seen.latencies);
            }
            tally.watchers += 1;
            tally.delivered += seen.delivered;
            tally.out_of_order += seen.out_of_order;
            if seen.stamped != events as u64 || !seen.sealed {
                tally.incomplete += 1;
            }
            if let Some((head, first, rest)) = tally.split.as_mut() {
                let at = (*head).min(seen.latencies.len());
                first.extend_from_slice(&seen.latencies[..at]);
                rest.extend_from_slice(&seen.latencies[at..]);
            }
            tally.early.extend(seen.early.iter().copied().zip(seen.latencies.iter().copied()));
            tally.latencies.extend(seen.latencies);
        }
        tally
    }

    /// p50 and p99 of the kept events by when they were sent: 100 ms slices of the second from
    /// `from` (micros since the epoch) on.
    pub(crate) fn by_send_time(&self, from: u64) -> Vec<Value> {
        let mut slices: Vec<Vec<u64>> = vec![Vec::new(); 10];
        for (sent, latency) in &self.early {
            if let Some(slice) = slices.get_mut((sent.saturating_sub(from) / 100_000) as usize) {
                slice.push(*latency);
            }
        }
        slices
            .iter_mut()
            .enumerate()
            .filter(|(_, v)| !v.is_empty())
            .map(|(i, v)| {
                v.sort_unstable();
                json!({
                    "sent_from_ms": i * 100,
                    "deliveries": v.len(),
                    "latency_p50_ms": percentile(v, 0.5) as f64 / 1000.0,
                    "latency_p99_ms": percentile(v, 0.99) as f64 / 1000.0,
                })
            })
            .collect()
    }

    /// The p99 of every watcher's first `head` events and of the rest (see `split`).
    /// `None` for a part with no events.
    pub(crate) fn split_p99(&mut self) -> (Option<f64>, Option<f64>) {
        let Some((_, first, rest)) = self.split.as_mut() else { return (None, None) };
        let p99 = |v: &mut Vec<u64>| {
            v.sort_unstable();
            (!v.is_empty()).then(|| percentile(v, 0.99) as f64 / 1000.0)
        };
        (p99(first), p99(rest))
    }

    /// Waits for every watcher; returns the tally, the seconds since `started` and what the
    /// server used since `before`, both read before the latencies are sorted (20 million of
    /// them take a while).
    pub(crate) async fn finish(
        watching: tokio::task::JoinHandle<Vec<Seen>>,
        events: usize,
        head: usize,
        started: Instant,
        before: Usage,
        pids: &[u32],
    ) -> (Tally, f64, Usage) {
        let mut tally = Tally::collect(watching, events, head).await;
        let elapsed = started.elapsed().as_secs_f64();
        let used = Usage::read(pids).since(before);
        tally.latencies.sort_unstable();
        tally.held.sort_unstable();
        tally.since_newest.sort_unstable();
        (tally, elapsed, used)
    }

    pub(crate) fn correct(&self) -> bool {
        self.out_of_order == 0 && self.incomplete == 0 && self.watchers > 0
    }

    pub(crate) fn p(&self, p: f64) -> f64 {
        percentile(&self.latencies, p) as f64 / 1000.0
    }

    /// The p99 of each part of the latencies (see `held`), in milliseconds.
    pub(crate) fn parts_p99(&self) -> Value {
        json!({
            "latency_held_p99_ms": percentile(&self.held, 0.99) as f64 / 1000.0,
            "latency_since_newest_p99_ms": percentile(&self.since_newest, 0.99) as f64 / 1000.0,
        })
    }
}

/// Where a fan-out runs: the turn (or publish) goes to `base`; watchers subscribe at each of
/// `nodes` in turn.
pub(crate) struct Target<'a> {
    pub(crate) base: &'a str,
    pub(crate) publish: &'a str,
    pub(crate) nodes: &'a [String],
    pub(crate) node_pids: &'a [u32],
}

pub(crate) async fn fanout(
    server: Server,
    transport: Transport,
    target: Target<'_>,
    watchers: usize,
    events: usize,
    rate: u64,
    pids: &[u32],
) -> Value {
    let Target { base, publish: publish_base, nodes, node_pids } = target;
    let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let channel = format!("fanout{}", now_micros());
    let mut subscriptions = Vec::with_capacity(watchers);
    for i in 0..watchers {
        subscriptions.push(subscribe(server, transport.nth(i), &nodes[i % nodes.len()], &channel).await);
    }
    let watching = watch_all(server, subscriptions, events, 0, nodes.len());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = Usage::read(pids);
    let nodes_before: Vec<Usage> = node_pids.iter().map(|pid| Usage::read(&[*pid])).collect();
    let started = Instant::now();
    match server {
        Server::Gateway => start_turn(&client, base, &channel, &format!("fanout-{events}-{rate}")).await,
        Server::Nchan | Server::Pushpin => publish(server, &client, publish_base, &channel, events, rate).await,
    }
    let (mut tally, elapsed, used) = Tally::finish(watching, events, 0, started, before, pids).await;
    let nodes_used: Vec<Usage> =
        node_pids.iter().zip(nodes_before).map(|(pid, before)| Usage::read(&[*pid]).since(before)).collect();
    let cpu = used.cpu_us();
    let mut result = json!({
        "transport": format!("{transport:?}").to_lowercase(),
        "watchers": watchers,
        "events": events,
        "rate": rate,
        "delivered": tally.delivered,
        "seconds": elapsed,
        "deliveries_per_second": tally.delivered as f64 / elapsed,
        "server_cpu_us_per_delivery": cpu as f64 / tally.delivered.max(1) as f64,
        "latency_p50_ms": tally.p(0.50),
        "latency_p99_ms": tally.p(0.99),
        "out_of_order": tally.out_of_order,
        "incomplete_watchers": tally.incomplete,
        "correct": tally.correct(),
    });
    merge(&mut result, used.split(tally.delivered));
    merge(&mut result, tally.parts_p99());
    if nodes.len() > 1 {
        let per_node: Vec<Value> = tally
            .by_group
            .iter_mut()
            .enumerate()
            .map(|(i, (delivered, latencies))| {
                latencies.sort_unstable();
                let cpu = nodes_used.get(i).map(|u| u.cpu_us() as f64 / (*delivered).max(1) as f64);
                json!({
                    "base": nodes[i],
                    "delivered": delivered,
                    "latency_p50_ms": percentile(latencies, 0.50) as f64 / 1000.0,
                    "latency_p99_ms": percentile(latencies, 0.99) as f64 / 1000.0,
                    "server_cpu_us_per_delivery": cpu,
                })
            })
            .collect();
        result["nodes"] = Value::Array(per_node);
    }
    result
}

/// Adds the fields of `more` to the object `into`.
pub(crate) fn merge(into: &mut Value, more: Value) {
    if let (Value::Object(into), Value::Object(more)) = (into, more) {
        into.extend(more);
    }
}
