//! Turns: starting them (one at a time per conversation), running them, and sealing them.
//!
//! [`Turns`] owns the set of running turns. A started turn runs in its own task
//! (`run.rs`): it maps the runtime's raw events onto the wire, publishes them to the hub,
//! writes the log and the metrics, and seals.

mod assembly;
mod run;
mod tally;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

pub use assembly::ChunkAssembler;
pub use tally::{OpenStep, StepTiming, TurnTally};

use crate::hub::{Hub, TurnBuffer};
use crate::runtime::{Registry, TurnRequest};
use crate::store::{BeginTurn, Store, StoreError, now_ms};
use crate::wire::{AgentEvent, TurnInputEvent, TurnStartEvent};

/// A request to start a turn, already validated for shape.
#[derive(Debug, Clone)]
pub struct StartTurn {
    pub conversation_id: String,
    /// Trimmed, non-empty.
    pub message: String,
    pub model: Option<String>,
    pub cwd: Option<String>,
    pub reasoning_effort: Option<String>,
}

/// A turn that has begun: its user message is in the log and its buffer is open.
pub struct Started {
    pub conversation_id: String,
    pub turn_id: String,
    pub buffer: Arc<TurnBuffer>,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("unknown model {0:?}")]
    UnknownModel(String),
    #[error("a turn is already generating for this conversation")]
    Busy,
    #[error(transparent)]
    Store(#[from] StoreError),
}

enum Slot {
    /// Reserved while the turn's first rows are written.
    Starting,
    Running {
        cancel: CancellationToken,
    },
    /// Reserved while the conversation is deleted.
    Deleting,
}

pub struct Turns {
    store: Store,
    hub: Arc<Hub>,
    registry: Arc<Registry>,
    slots: Mutex<HashMap<String, Slot>>,
}

/// Frees a reserved slot unless the reservation was turned into a running turn.
struct Reservation<'a> {
    turns: &'a Turns,
    conversation_id: &'a str,
    armed: bool,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.turns.release(self.conversation_id);
        }
    }
}

impl Turns {
    pub fn new(store: Store, hub: Arc<Hub>, registry: Arc<Registry>) -> Arc<Turns> {
        Arc::new(Turns {
            store,
            hub,
            registry,
            slots: Mutex::new(HashMap::new()),
        })
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Whether a turn is running (or starting) in this conversation.
    pub fn is_active(&self, conversation_id: &str) -> bool {
        matches!(
            self.lock().get(conversation_id),
            Some(Slot::Starting | Slot::Running { .. })
        )
    }

    /// Starts a turn: picks the model, reserves the conversation (409 when busy), writes the
    /// user's chunk, opens the replay buffer with `user-message` and `turn-start`, and spawns
    /// the turn. Nothing is emitted when it fails.
    pub async fn start(self: &Arc<Self>, req: StartTurn) -> Result<Started, StartError> {
        let model = match &req.model {
            Some(m) => m.clone(),
            None => self
                .store
                .conversation_model(&req.conversation_id)
                .await?
                .unwrap_or_else(|| self.registry.default_model().to_owned()),
        };
        let Some((runtime, native_model)) = self.registry.resolve(&model) else {
            return Err(StartError::UnknownModel(model));
        };
        let mut reservation = self.reserve(&req.conversation_id, Slot::Starting)?;

        let turn_id = uuid::Uuid::now_v7().to_string();
        self.store
            .begin_turn(BeginTurn {
                conversation_id: &req.conversation_id,
                turn_id: &turn_id,
                model: &model,
                user_text: &req.message,
                default_title: &default_title(&req.message),
                now: now_ms(),
            })
            .await?;

        let buffer = self.hub.begin_turn(&req.conversation_id, &turn_id);
        let ids = (req.conversation_id.clone(), turn_id.clone());
        buffer.publish(&AgentEvent::UserMessage(TurnInputEvent {
            conversation_id: ids.0.clone(),
            turn_id: ids.1.clone(),
            text: req.message.clone(),
        }));
        buffer.publish(&AgentEvent::TurnStart(TurnStartEvent {
            conversation_id: ids.0.clone(),
            turn_id: ids.1.clone(),
        }));

        let cancel = CancellationToken::new();
        self.lock().insert(
            req.conversation_id.clone(),
            Slot::Running {
                cancel: cancel.clone(),
            },
        );
        reservation.armed = false;

        let request = TurnRequest {
            conversation_id: req.conversation_id.clone(),
            turn_id: turn_id.clone(),
            model: native_model.to_owned(),
            prompt: req.message,
            cwd: req.cwd,
            reasoning_effort: req.reasoning_effort,
        };
        let run = run::TurnRun::new(self.clone(), self.store.clone(), buffer.clone(), cancel);
        tokio::spawn(run.drive(runtime, request));
        Ok(Started {
            conversation_id: ids.0,
            turn_id: ids.1,
            buffer,
        })
    }

    /// Deletes a conversation unless a turn runs in it. `Ok(false)` when it did not exist.
    pub async fn delete(&self, conversation_id: &str) -> Result<bool, StartError> {
        let _reservation = self.reserve(conversation_id, Slot::Deleting)?;
        Ok(self.store.delete_conversation(conversation_id).await?)
    }

    /// Asks every running turn to end (`done{aborted}`); used at shutdown.
    pub fn abort_all(&self) {
        for slot in self.lock().values() {
            if let Slot::Running { cancel } = slot {
                cancel.cancel();
            }
        }
    }

    /// Number of turns running now.
    pub fn running(&self) -> usize {
        self.lock()
            .values()
            .filter(|s| matches!(s, Slot::Running { .. }))
            .count()
    }

    fn reserve<'a>(
        &'a self,
        conversation_id: &'a str,
        slot: Slot,
    ) -> Result<Reservation<'a>, StartError> {
        let mut slots = self.lock();
        if slots.contains_key(conversation_id) {
            return Err(StartError::Busy);
        }
        slots.insert(conversation_id.to_owned(), slot);
        Ok(Reservation {
            turns: self,
            conversation_id,
            armed: true,
        })
    }

    /// Called by a turn right before it publishes `turn-sealed`: from then on the
    /// conversation accepts a new turn.
    fn release(&self, conversation_id: &str) {
        self.lock().remove(conversation_id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }
}

/// The title a conversation gets from its first message: its first line, at most 80 chars.
fn default_title(message: &str) -> String {
    let line = message.lines().next().unwrap_or("").trim();
    match line.char_indices().nth(80) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line.to_owned(),
    }
}
