//! What the turns need of a cluster's other gateways, as a trait the bus implements
//! (`src/bus/cluster.rs`), as the hub's [`Remote`](crate::hub::Remote) is: the turns know no
//! NATS, and a gateway alone (or a build without the `cluster` feature) has none.

use std::sync::Weak;

use futures_util::future::BoxFuture;

use super::{Control, ControlReply, Turns};
use crate::wire::ConversationStatus;

pub trait Cluster: Send + Sync {
    /// Tells the other gateways of a status change made here (without waiting: held while
    /// they cannot be reached).
    fn announce(&self, conversation_id: &str, status: ConversationStatus);

    /// Asks the gateway running the conversation's turn to carry `request` out: its answer,
    /// `None` when no gateway answered, an error (said in the log) when it could not be asked.
    fn control<'a>(&'a self, request: &'a Control) -> BoxFuture<'a, Result<Option<ControlReply>, String>>;

    /// Whether the other gateways can be reached now.
    fn connected(&self) -> bool;

    /// Ends, for the watchers on every gateway, a turn this one marked interrupted (its own
    /// gateway died).
    fn end_interrupted<'a>(&'a self, conversation_id: &'a str, turn_id: &'a str) -> BoxFuture<'a, Result<(), String>>;

    /// Starts handing `turns` what the other gateways send: their status changes
    /// ([`Turns::hear_status`]) and control requests ([`Turns::answer`]), until it is gone.
    fn serve(&self, turns: Weak<Turns>);
}
