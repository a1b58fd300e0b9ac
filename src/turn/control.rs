//! What one gateway asks of the one running a conversation's turn (`/stop`, `/close`,
//! `/queue` sent elsewhere), and its answers: the bus carries them as JSON (src/bus/control.rs).

use serde::{Deserialize, Serialize};

use crate::runtime::{QueueFull, QueuedMessage};

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "camelCase")]
pub enum Control {
    Stop { conversation_id: String },
    Queue { conversation_id: String, message: QueuedMessage },
}

impl Control {
    pub fn conversation_id(&self) -> &str {
        match self {
            Control::Stop { conversation_id } | Control::Queue { conversation_id, .. } => conversation_id,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ControlReply {
    /// Whether a turn was aborted.
    Stopped(bool),
    /// The messages now waiting for the turn's next step, or why this one could not wait.
    Queued(Result<Vec<QueuedMessage>, QueueFull>),
}
