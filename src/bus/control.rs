//! Control of a turn from any gateway: `/stop`, `/close` and `/queue` sent to a gateway that
//! does not run the conversation's turn go over plain NATS to the one that does.
//!
//! A request names the conversation in its subject; every gateway listens, and only the one
//! whose turn holds the conversation answers (the others stay silent, so the first answer is
//! the right one). A gateway asks only while the conversation's lease is held elsewhere.

use futures_util::StreamExt;

use super::sign::reject;
use super::{Bus, BusError, token};
use crate::turn::{Control, ControlReply};

const SUBJECTS: &str = "dispatch.control.*";

impl Bus {
    /// Asks the gateway running the conversation's turn; none when no gateway answered in
    /// time (its turn ended meanwhile, or it is gone).
    pub(super) async fn control(&self, request: &Control) -> Result<Option<ControlReply>, BusError> {
        let subject = format!("dispatch.control.{}", token(request.conversation_id()));
        let payload = serde_json::to_vec(request).expect("a control request serializes");
        let mut headers = async_nats::HeaderMap::new();
        self.0.signer.sign_fresh(&subject, &mut headers, &payload);
        match self.0.client.request_with_headers(subject, headers, payload.into()).await {
            // An answer not signed with the cluster's key is no gateway's: as if none came.
            Ok(reply) if !self.0.signer.verify_fresh(&reply.subject, reply.headers.as_ref(), &reply.payload) => {
                reject(&self.0.metrics, "a control reply", &reply.subject);
                Ok(None)
            }
            Ok(reply) => serde_json::from_slice(&reply.payload).map(Some).map_err(BusError::js),
            Err(e)
                if matches!(
                    e.kind(),
                    async_nats::RequestErrorKind::TimedOut | async_nats::RequestErrorKind::NoResponders
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(BusError::js(e)),
        }
    }
}

/// Answers the requests `answer` has an answer for (those for turns this gateway runs),
/// until it is told to stop (`answer` returns `Err`).
pub(super) async fn serve_control(bus: Bus, answer: impl Fn(Control) -> Result<Option<ControlReply>, ()>) {
    let Some(mut subscriber) = bus.listen(SUBJECTS, "control requests").await else { return };
    while let Some(message) = subscriber.next().await {
        let Some(reply_to) = message.reply.clone() else { continue };
        if !bus.0.signer.verify_fresh(&message.subject, message.headers.as_ref(), &message.payload) {
            reject(&bus.0.metrics, "a control request", &message.subject);
            continue;
        }
        let Ok(request) = serde_json::from_slice::<Control>(&message.payload) else {
            tracing::warn!("skipped a control request that does not parse");
            continue;
        };
        let Ok(answer) = answer(request) else { return };
        if let Some(reply) = answer {
            let payload = serde_json::to_vec(&reply).expect("a control reply serializes");
            let mut headers = async_nats::HeaderMap::new();
            bus.0.signer.sign_fresh(&reply_to, &mut headers, &payload);
            if let Err(e) = bus.0.client.publish_with_headers(reply_to, headers, payload.into()).await {
                tracing::warn!(error = %e, "could not answer a control request");
            }
        }
    }
}
