//! The bus as the turns' [`Cluster`]: what a turn here says reaches the other gateways, and
//! what they say reaches this gateway's turns.

use std::sync::Weak;

use futures_util::future::BoxFuture;

use super::{Bus, control, interrupted, status};
use crate::turn::{Cluster, Control, ControlReply, Turns};
use crate::wire::ConversationStatus;

impl Cluster for Bus {
    fn announce(&self, conversation_id: &str, status: ConversationStatus) {
        Bus::announce(self, conversation_id, status);
    }

    fn control<'a>(&'a self, request: &'a Control) -> BoxFuture<'a, Result<Option<ControlReply>, String>> {
        Box::pin(async move { Bus::control(self, request).await.map_err(|e| e.to_string()) })
    }

    fn connected(&self) -> bool {
        Bus::connected(self)
    }

    fn end_interrupted<'a>(&'a self, conversation_id: &'a str, turn_id: &'a str) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            interrupted::end_interrupted(self, conversation_id, turn_id).await.map_err(|e| e.to_string())
        })
    }

    fn serve(&self, turns: Weak<Turns>) {
        let hear = turns.clone();
        tokio::spawn(status::relay_statuses(self.clone(), move |conversation_id, status| {
            let Some(turns) = hear.upgrade() else { return false };
            turns.hear_status(conversation_id, status);
            true
        }));
        tokio::spawn(control::serve_control(self.clone(), move |request| {
            turns.upgrade().map(|turns| turns.answer(request)).ok_or(())
        }));
    }
}
