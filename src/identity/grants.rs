//! What a credential opened, so that taking it back ends it at once (docs/identity.md). Every
//! live stream of a signed-in caller (SSE, NDJSON, a WebSocket session) holds a grant here for
//! as long as it is open, naming its subject, credential, session and expiry.
//!
//! - On the gateway that takes a credential back (a sign-out, `DELETE /auth/sessions?subject=`,
//!   a revoked key), its grants end at once.
//! - Every gateway looks again every [`LOOK_EVERY`] at what its grants stand on: the expiry
//!   (a token's `exp`, a session's end, a made key's expiry), the sessions and made keys in the
//!   database (so what another gateway of a cluster took back ends here within that bound), the
//!   configured keys and the JWKS as last read (a withdrawn key ends its tokens' streams).
//!
//! A stream whose grant ends gets an `error` event (`unauthorized`) and closes; a WebSocket
//! session closes with 1008 and the reason. The same check refuses the requests that come
//! after, so a frame or request sent after that changes nothing.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Authenticator, Identity, KEY_SUBJECT_PREFIX};
use crate::metrics::Ending;
use crate::store::now_ms;

/// How often a gateway looks again at what its open streams stand on.
pub const LOOK_EVERY: Duration = Duration::from_secs(2);

struct Grant {
    subject: Arc<str>,
    credential: Arc<str>,
    session: Option<Arc<str>>,
    /// Unix seconds.
    expires_at: Option<u64>,
    ending: Ending,
}

/// The open streams of signed-in callers, by grant.
#[derive(Default)]
pub struct Grants {
    open: Mutex<HashMap<u64, Grant>>,
    next: AtomicU64,
}

/// A stream's grant: dropped with the stream, it leaves the registry.
pub struct Held {
    grants: Weak<Grants>,
    id: u64,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(grants) = self.grants.upgrade() {
            grants.lock().remove(&self.id);
        }
    }
}

impl Grants {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Grant>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A grant for a stream of `identity`, ending under `drained` too (none with auth off: an
    /// anonymous stream has nothing to take back).
    pub fn hold(self: &Arc<Self>, identity: &Identity, drained: &CancellationToken) -> Option<(Ending, Held)> {
        if identity.anonymous {
            return None;
        }
        let ending = Ending::under(drained);
        let id = self.next.fetch_add(1, Relaxed);
        let grant = Grant {
            subject: identity.subject.clone(),
            credential: identity.credential.clone(),
            session: identity.session.clone(),
            expires_at: identity.expires_at,
            ending: ending.clone(),
        };
        self.lock().insert(id, grant);
        Some((ending, Held { grants: Arc::downgrade(self), id }))
    }

    /// Ends the grants `which` picks, saying `why`; how many.
    fn end_where(&self, why: &str, which: impl Fn(&Grant) -> bool) -> usize {
        let ended: Vec<Ending> = self.lock().values().filter(|g| which(g)).map(|g| g.ending.clone()).collect();
        for ending in &ended {
            ending.end(why);
        }
        ended.len()
    }

    /// The streams the session `id_hash` opened.
    pub fn end_session(&self, id_hash: &str, why: &str) -> usize {
        self.end_where(why, |g| g.session.as_deref() == Some(id_hash))
    }

    /// The streams `subject`'s sessions opened.
    pub fn end_sessions_of(&self, subject: &str, why: &str) -> usize {
        self.end_where(why, |g| g.session.is_some() && &*g.subject == subject)
    }

    /// The streams `credential` opened, itself or through a session.
    pub fn end_credential(&self, credential: &str, why: &str) -> usize {
        self.end_where(why, |g| &*g.credential == credential)
    }

    /// How many grants are open (for tests and the look below).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Looks again, every [`LOOK_EVERY`], at what every open grant stands on, for as long as the
/// gateway runs.
pub(super) async fn sweep(auth: Weak<Authenticator>) {
    let mut tick = tokio::time::interval(LOOK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(auth) = auth.upgrade() else { return };
        if auth.grants.is_empty() {
            continue;
        }
        look(&auth).await;
    }
}

async fn look(auth: &Authenticator) {
    let grants = &auth.grants;
    let now = now_ms();
    grants
        .end_where("your sign-in expired", |g| g.expires_at.is_some_and(|exp| exp.saturating_mul(1000) <= now as u64));
    grants.end_where("the credential was taken back", |g| !auth.credential_live(&g.credential));
    // The database's part: sessions and made keys another gateway may have ended.
    let (sessions, keys) = {
        let open = grants.lock();
        let sessions: HashSet<Arc<str>> = open.values().filter_map(|g| g.session.clone()).collect();
        let keys: HashSet<Arc<str>> =
            open.values().filter_map(|g| g.credential.strip_prefix(KEY_SUBJECT_PREFIX).map(Arc::from)).collect();
        (sessions, keys)
    };
    if !sessions.is_empty() {
        let asked: Vec<&str> = sessions.iter().map(|s| &**s).collect();
        match auth.store.live_sessions(&asked, now).await {
            Ok(live) => {
                let live: HashSet<String> = live.into_iter().collect();
                grants.end_where("your session ended (signed out, or taken back)", |g| {
                    g.session.as_deref().is_some_and(|s| !live.contains(s))
                });
            }
            Err(e) => tracing::warn!(error = %e, "cannot look at the sessions behind open streams"),
        }
    }
    if !keys.is_empty() {
        let asked: Vec<&str> = keys.iter().map(|s| &**s).collect();
        match auth.store.live_keys(&asked, now).await {
            Ok(live) => {
                let live: HashSet<String> = live.into_iter().collect();
                grants.end_where("the key was revoked or expired", |g| {
                    g.credential.strip_prefix(KEY_SUBJECT_PREFIX).is_some_and(|id| !live.contains(id))
                });
            }
            Err(e) => tracing::warn!(error = %e, "cannot look at the keys behind open streams"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signed_in(subject: &str, credential: &str, session: Option<&str>) -> Identity {
        let mut identity = Identity::signed(Arc::from(subject), false, None, Arc::from(credential));
        identity.session = session.map(Arc::from);
        identity
    }

    /// Each way of taking back ends exactly the grants it names, saying why; a stream that
    /// ended leaves the registry; an anonymous caller holds nothing.
    #[test]
    fn taking_back_ends_only_what_it_names() {
        let grants = Arc::new(Grants::default());
        let drained = CancellationToken::new();
        let (by_session, _a) = grants.hold(&signed_in("alice", "token:k1", Some("s1")), &drained).unwrap();
        let (by_token, _b) = grants.hold(&signed_in("alice", "token:k1", None), &drained).unwrap();
        let (by_key, _c) = grants.hold(&signed_in("key:7", "key:7", None), &drained).unwrap();
        let (other, held) = grants.hold(&signed_in("bob", "token:k1", Some("s2")), &drained).unwrap();
        assert!(grants.hold(&Identity::anonymous(), &drained).is_none());
        assert_eq!(grants.len(), 4);

        assert_eq!(grants.end_session("s1", "signed out"), 1);
        assert_eq!(by_session.why(), Some("signed out"));
        assert!(by_session.token.is_cancelled() && !by_token.token.is_cancelled());
        assert_eq!(
            grants.end_sessions_of("alice", "ended"),
            1,
            "alice's one session again; her token's stream is no session"
        );
        assert_eq!(grants.end_credential("key:7", "revoked"), 1);
        assert_eq!(by_key.why(), Some("revoked"));
        assert!(!other.token.is_cancelled() && !by_token.token.is_cancelled());
        drop(held);
        assert_eq!(grants.len(), 3, "a stream that ended left");
        // The shutdown ends every stream too, without a reason of its own.
        drained.cancel();
        assert!(by_token.token.is_cancelled() && by_token.why().is_none());
    }
}
