//! The leases of this gateway's turns and deletions, kept (store/lease.rs says what a lease
//! is): renewed, found lost, and, with other gateways on the database, taken over when theirs
//! ended.

use std::sync::Weak;

use super::Turns;
use crate::store::{Store, now_ms};
use crate::wire::ConversationStatus;

/// Every third of the lease's time: renews the leases of this gateway's turns and deletions,
/// finishes the deletions whose lease ended (store/deletion.rs), and, when other gateways may
/// share the database, marks the turns whose lease ended (their gateway died, or lost the
/// database for longer than a lease) interrupted; one gateway of several does each
/// (store/lease.rs). Ends when the gateway is dropped.
pub(super) async fn keep(turns: Weak<Turns>, store: Store) {
    let mut tick = tokio::time::interval(store.lease_ttl() / 3);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(turns) = turns.upgrade() else { return };
        let held = turns.busy.leased();
        if !held.is_empty() {
            match store.renew_leases(&held).await {
                // Fewer renewed than held: some lease is gone (this gateway was paused past it
                // and another marked the turn interrupted). Its turn ends now, saying so, rather
                // than streaming on to its watchers until its next write is refused.
                Ok(renewed) if (renewed as usize) < held.len() => match store.holding_leases(&held).await {
                    Ok(holding) => turns.busy.lost_leases(held.iter().filter(|t| !holding.contains(t))),
                    Err(e) => tracing::warn!(error = %e, "could not tell which leases are gone"),
                },
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, turns = held.len(), "could not renew the leases of running turns"),
            }
        }
        // This gateway's own conversations are not swept by it (those busy now: a turn may have
        // started since `held` was taken): a turn whose renewal failed learns of a lost lease
        // at its next write.
        let mine = |conversation_id: &str| turns.busy.holds(conversation_id);
        match store.expired_deletions().await {
            // Each in a task of its own: a long one must not hold up the renewals.
            Ok(cut) => {
                for (conversation_id, holder) in cut.into_iter().filter(|(c, _)| !mine(c)) {
                    let turns = turns.clone();
                    tokio::spawn(async move { turns.resume_deletion(&conversation_id, &holder).await });
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not look for deletions whose lease ended"),
        }
        if store.exclusive() {
            continue;
        }
        let now = now_ms();
        let expired = match store.expired_leases().await {
            Ok(expired) => expired,
            Err(e) => {
                tracing::warn!(error = %e, "could not look for turns whose lease ended");
                continue;
            }
        };
        for (conversation_id, turn_id) in expired.into_iter().filter(|(c, _)| !mine(c)) {
            match store.interrupt_expired(&conversation_id, &turn_id, now).await {
                Ok(true) => {
                    tracing::warn!(conversation = %conversation_id, turn = %turn_id, "marked a turn whose lease ended interrupted");
                    if let Some(cluster) = &turns.cluster
                        && let Err(e) = cluster.end_interrupted(&conversation_id, &turn_id).await
                    {
                        tracing::warn!(conversation = %conversation_id, error = %e, "could not end the interrupted turn on the bus");
                    }
                    turns.announce(&conversation_id, ConversationStatus::Idle);
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(conversation = %conversation_id, error = %e, "could not mark a turn whose lease ended")
                }
            }
        }
    }
}
