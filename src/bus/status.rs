//! Status changes (`conversation.statusChanged`) between gateways, over plain NATS: a change
//! is news only while it happens, so it is not kept in the stream.

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};

use super::Bus;
use super::sign::{Signer, reject};
use crate::wire::ConversationStatus;

const SUBJECT: &str = "dispatch.status";

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Change {
    node: String,
    conversation_id: String,
    status: ConversationStatus,
}

impl Bus {
    /// Tells the other gateways of a change made here (sent in order, without waiting).
    pub fn announce(&self, conversation_id: &str, status: ConversationStatus) {
        let change = Change { node: self.0.node.clone(), conversation_id: conversation_id.to_owned(), status };
        let payload = serde_json::to_vec(&change).expect("a status change serializes");
        let _ = self.0.statuses.send(payload.into());
    }
}

/// Sends the changes announced here, one after the other (the client queues them in order),
/// each signed and stamped with when it was sent.
pub(super) async fn send_statuses(
    client: async_nats::Client,
    signer: std::sync::Arc<Signer>,
    mut changes: tokio::sync::mpsc::UnboundedReceiver<bytes::Bytes>,
) {
    while let Some(payload) = changes.recv().await {
        let mut headers = async_nats::HeaderMap::new();
        signer.sign_fresh(SUBJECT, &mut headers, &payload);
        if let Err(e) = client.publish_with_headers(SUBJECT, headers, payload).await {
            tracing::warn!(error = %e, "could not send a status change to the bus");
        }
    }
}

/// Hands every change the other gateways announce to `deliver`, until it returns false.
pub async fn relay_statuses(bus: Bus, deliver: impl Fn(&str, ConversationStatus) -> bool) {
    let Some(mut subscriber) = bus.listen(SUBJECT, "status changes").await else { return };
    while let Some(message) = subscriber.next().await {
        if !bus.0.signer.verify_fresh(&message.subject, message.headers.as_ref(), &message.payload) {
            reject(&bus.0.metrics, "a status change", &message.subject);
            continue;
        }
        let Ok(change) = serde_json::from_slice::<Change>(&message.payload) else {
            tracing::warn!("skipped a status change that does not parse");
            continue;
        };
        if change.node != bus.0.node && !deliver(&change.conversation_id, change.status) {
            return;
        }
    }
}
