//! What the turns' writes carry (`batch.rs` queues them; `log.rs` and `turns.rs` make them):
//! a file of its own, below the three, so that none of them imports another in a circle.

use crate::wire::{Chunk, Role, TurnMetrics};

/// A chunk about to be appended.
#[derive(Debug, Clone)]
pub struct NewChunk {
    pub role: Role,
    pub chunk: Chunk,
    /// True when this chunk opens a new message; false continues the conversation's last one.
    pub new_message: bool,
}

/// A turn to open: its row, its user's chunk, and what the conversation learns from it.
pub struct BeginTurn<'a> {
    pub conversation_id: &'a str,
    pub turn_id: &'a str,
    pub model: &'a str,
    /// The model the request named: it becomes the conversation's sticky model.
    pub sticky_model: Option<&'a str>,
    pub user_text: &'a str,
    /// Title given to a conversation the turn creates, or one whose title is still empty.
    pub default_title: &'a str,
    /// Recorded in the same transaction, so a retried request finds it whatever happens next.
    pub idempotency: Option<IdempotencyRecord<'a>>,
    /// The owner of a conversation the turn creates.
    pub owner: Option<&'a str>,
    /// The subject's quotas, checked and the turn counted in the same transaction (none: an
    /// administrator, or no quotas).
    pub budget: Option<&'a super::TurnBudget>,
    pub now: i64,
}

/// An `Idempotency-Key` with the request it came with and the answer it got.
pub struct IdempotencyRecord<'a> {
    pub key: &'a str,
    pub body_hash: &'a str,
    pub response: &'a str,
}

/// A turn to seal: its end and its metrics.
pub struct SealTurn<'a> {
    pub conversation_id: &'a str,
    pub turn_id: &'a str,
    pub reason: &'a str,
    pub metrics: &'a TurnMetrics,
    pub now: i64,
    /// What the runtime reported as `TokensPerEstimate`, kept with the conversation for its
    /// next turn (`None` keeps what was there).
    pub tokens_per_estimate: Option<f64>,
    /// What the turn costs its subject's day of tokens (none: not counted).
    pub charge: Option<Charge<'a>>,
}

/// Tokens a sealed turn costs the subject whose quota counted it.
#[derive(Debug, Clone, Copy)]
pub struct Charge<'a> {
    pub subject: &'a str,
    pub tokens: u64,
}
