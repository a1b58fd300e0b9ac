//! How many watchers every gateway has, shared so that each sizes its flush window by the
//! cluster's watchers rather than its own (`docs/cluster.md`, "Pacing across gateways").
//!
//! The flush window trades a delta's wait for fewer writes, and its size follows the watchers
//! reading in-flight turns (`hub/pacing.rs`). Sized by a gateway's own, watchers spread over
//! three gateways got a third of the window, so a third of the deltas per write: the cluster
//! wrote twice as often per delivery as one gateway holding them all (W2 spread over three,
//! BENCHMARKS.md). With the counts shared, a delta waits as long whichever gateway its watcher
//! reads from, and spreading watchers changes neither the latency nor the writes per delivery.
//!
//! Each gateway says its count every [`EVERY`] over plain NATS (news only while it happens, as
//! status changes are), signed and stamped like them; a count not repeated within [`STALE`]
//! (its gateway stopped or cannot reach the bus) no longer counts.

use std::collections::HashMap;
use std::sync::Weak;
use std::time::Duration;

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::Inner;
use super::sign::reject;
use crate::hub::Hub;

const SUBJECT: &str = "dispatch.readers";

/// How often a gateway says its count.
const EVERY: Duration = Duration::from_secs(1);

/// How long a count holds without being said again.
const STALE: Duration = Duration::from_secs(3);

/// Most gateways counted: only signed messages come in, but a map filled from the network is
/// bounded anyway.
const MOST_NODES: usize = 1_024;

#[derive(Serialize, Deserialize)]
struct Count {
    node: String,
    readers: usize,
}

/// Says this gateway's count and hears the others' until `hub` is gone, keeping the hub's count
/// of watchers elsewhere current.
pub(super) async fn share(inner: std::sync::Arc<Inner>, hub: Weak<Hub>) {
    let Some(mut subscriber) = super::Bus(inner.clone()).listen(SUBJECT, "watcher counts").await else { return };
    let mut counts: HashMap<String, (usize, Instant)> = HashMap::new();
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let Some(hub) = hub.upgrade() else { return };
                say(&inner, hub.readers()).await;
            }
            message = subscriber.next() => {
                let Some(message) = message else { return };
                if !inner.signer.verify_fresh(&message.subject, message.headers.as_ref(), &message.payload) {
                    reject(&inner.metrics, "a watcher count", &message.subject);
                    continue;
                }
                let Ok(count) = serde_json::from_slice::<Count>(&message.payload) else { continue };
                if count.node != inner.node && (counts.len() < MOST_NODES || counts.contains_key(&count.node)) {
                    counts.insert(count.node, (count.readers, Instant::now()));
                }
            }
        }
        let now = Instant::now();
        counts.retain(|_, (_, at)| now.duration_since(*at) < STALE);
        let Some(hub) = hub.upgrade() else { return };
        hub.set_readers_elsewhere(counts.values().map(|(readers, _)| *readers).fold(0, usize::saturating_add));
    }
}

async fn say(inner: &Inner, readers: usize) {
    let payload = serde_json::to_vec(&Count { node: inner.node.clone(), readers }).expect("a count serializes");
    let mut headers = async_nats::HeaderMap::new();
    inner.signer.sign_fresh(SUBJECT, &mut headers, &payload);
    // Not sent while the bus is down: the next tick says it again.
    if super::connected(&inner.client) {
        let _ = inner.client.publish_with_headers(SUBJECT, headers, payload.into()).await;
    }
}
