//! The flush window across gateways: sized by the cluster's watchers, a round's deltas as one
//! message.

use super::*;

/// A gateway's watchers reading turns, those it counts elsewhere, and its flush window.
async fn gauges(gateway: &Api) -> (f64, f64, f64) {
    let text = gateway.metrics().await;
    (
        metric(&text, "dispatch_watchers_reading"),
        metric(&text, "dispatch_watchers_reading_elsewhere"),
        metric(&text, "dispatch_flush_window_seconds"),
    )
}

/// The flush window is the cluster's: a gateway with no watchers of its own, while another has
/// four reading a turn, counts them (`dispatch_watchers_reading_elsewhere`) and opens the window
/// it would open for four of its own; once they leave, it closes again. (Sized by its own
/// watchers alone, watchers spread over three gateways got a third of the window, and the
/// cluster wrote twice as often per delivery as one gateway: BENCHMARKS.md, W2.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_size_their_flush_window_by_the_clusters_watchers() {
    let Some(database) = fresh_database().await else { return };
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = write_script(dir.path(), steady());
    // Enough sweeps that four watchers open a window (at the first write cost, 4 us).
    let (a, b) = scripted_pair(&database.url, &nats.url, &script, &["--flush-sweeps", "1000"]);
    // A stranger on the bus says it has a million watchers, unsigned and signed with another
    // key: B counts none of them, and says it refused them.
    let raw = async_nats::connect(&nats.url).await.expect("a plain client of the test's NATS server");
    let forged = serde_json::to_vec(&json!({"node": "stranger", "readers": 1_000_000})).unwrap();
    for signature in [None, Some("00".repeat(32))] {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Dispatch-Sent", dispatch_gateway::store::now_ms().to_string().as_str());
        if let Some(signature) = &signature {
            headers.insert("Dispatch-Signature", signature.as_str());
        }
        raw.publish_with_headers("dispatch.readers", headers, forged.clone().into()).await.unwrap();
    }
    raw.flush().await.unwrap();
    let refused = |text: &str| metric(text, "dispatch_bus_rejected_total");
    assert!(
        eventually(200, || async { refused(&b.api.metrics().await) >= 2.0 }).await,
        "B refused the forged counts: {}",
        b.api.metrics().await
    );
    assert_eq!(gauges(&b.api).await, (0.0, 0.0, 0.0), "B alone has no watchers and no window");
    let mut watchers = Vec::new();
    for _ in 0..4 {
        watchers.push(a.sse("spread", "").await);
    }
    start_turn(&a, "spread", "steady").await;
    assert!(
        eventually(400, || async { gauges(&a.api).await.0 == 4.0 }).await,
        "A counts its four: {:?}",
        gauges(&a.api).await
    );
    assert!(
        eventually(200, || async {
            let (here, elsewhere, window) = gauges(&b.api).await;
            here == 0.0 && elsewhere == 4.0 && window > 0.0
        })
        .await,
        "B counts A's four and opens its window: {:?}",
        gauges(&b.api).await
    );
    let (status, _) = a.post("/conversations/spread/stop", json!({})).await;
    assert_eq!(status, 200);
    drop(watchers);
    assert!(
        eventually(200, || async { gauges(&b.api).await == (0.0, 0.0, 0.0) }).await,
        "B's window closes when A's watchers are gone: {:?}",
        gauges(&b.api).await
    );
}

/// Under a flush window a turn's deltas go to the bus as its rounds carry them, several to a
/// message, not a message each (each one costs nats-server its own work: as much again as the
/// following gateways' deliveries, BENCHMARKS.md W2). A plain client on the conversation's
/// subjects counts the messages; the watchers still read every event, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turns_deltas_go_to_the_bus_as_its_rounds_carry_them() {
    let Some(database) = fresh_database().await else { return };
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = json!({"rules": [{"pace": 500, "steps": [{"text": "word ", "repeat": 300}]}]});
    let script = write_script(dir.path(), script);
    // A window of 15 ms (the cap) for four watchers, over deltas 2 ms apart.
    let (a, b) = scripted_pair(&database.url, &nats.url, &script, &["--flush-sweeps", "100000"]);
    let raw = async_nats::connect(&nats.url).await.expect("a plain client of the test's NATS server");
    let hex: String = "rounds".bytes().map(|b| format!("{b:02x}")).collect();
    let mut messages = raw.subscribe(format!("dispatch.events.*.{hex}")).await.unwrap();
    raw.flush().await.unwrap();
    let mut watchers = Vec::new();
    for _ in 0..4 {
        watchers.push(a.sse("rounds", "").await);
    }
    let mut on_b = b.sse("rounds", "").await;
    start_turn(&a, "rounds", "go").await;
    let on_b = read(&on_b.until_sealed().await);
    let on_a = read(&watchers[0].until_sealed().await);
    assert_eq!(on_b, on_a, "B's watcher read what A's did");
    let deltas = on_a.iter().filter(|(_, e)| e["type"] == "text-delta").count();
    assert!(deltas >= 300, "{deltas}");
    let mut count = 0;
    while let Ok(Some(_)) =
        tokio::time::timeout(std::time::Duration::from_millis(500), futures_util::StreamExt::next(&mut messages)).await
    {
        count += 1;
    }
    assert!(count * 3 < on_a.len(), "{count} messages on the bus for {} events", on_a.len());
}
