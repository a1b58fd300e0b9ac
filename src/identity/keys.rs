//! Keys made at runtime, and taking keys and sessions back (docs/identity.md): `POST /keys`
//! makes a key and answers its secret once (`dk_` and 32 random bytes, URL-safe base64); the
//! database keeps its SHA-256. A made key's
//! subject is `key:<id>`, its credential the same; its quotas, when given, replace `[quotas]`
//! for it. Revoking removes it, and everything it opened ends (sessions, streams).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ring::digest::{SHA256, digest};

use super::{AuthError, Authenticator, Identity, KEY_SUBJECT_PREFIX, hex};
use crate::config::Quotas;
use crate::store::{StoreError, StoredKey, now_ms};

/// What a made key's secret begins with: a key, not a token, at a glance (and in a scanner's).
pub const MADE_KEY_PREFIX: &str = "dk_";

/// How often a key's `last_used_at` is written at most.
const LAST_USE_EVERY_MS: i64 = 60_000;

/// A key to make.
#[derive(Debug, Clone)]
pub struct NewKey {
    pub name: String,
    pub admin: bool,
    /// Unix ms.
    pub expires_at: Option<i64>,
    pub quotas: Option<Quotas>,
}

/// A key just made: its secret (shown this once) and what is stored of it.
#[derive(Debug, Clone)]
pub struct MadeKey {
    pub secret: String,
    pub key: StoredKey,
}

/// When each made key's use was last written (a write per request would be one per request).
#[derive(Default)]
pub(super) struct LastUse(Mutex<HashMap<String, i64>>);

impl LastUse {
    /// Whether a use at `now` is to be written.
    fn due(&self, id: &str, now: i64) -> bool {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() > 100_000 {
            seen.clear(); // bounded: at worst a few more writes
        }
        match seen.get(id) {
            Some(at) if now - at < LAST_USE_EVERY_MS => false,
            _ => {
                seen.insert(id.to_owned(), now);
                true
            }
        }
    }
}

fn hash_hex(secret: &str) -> String {
    hex(digest(&SHA256, secret.as_bytes()).as_ref())
}

/// The identity a made key's row gives.
fn identity_of(key: &StoredKey) -> Identity {
    let subject: Arc<str> = Arc::from(format!("{KEY_SUBJECT_PREFIX}{}", key.id));
    let expires_at = key.expires_at.map(|ms| (ms / 1000).max(0) as u64);
    let mut identity = Identity::signed(subject.clone(), key.admin, expires_at, subject);
    identity.quotas = key.quotas.as_deref().and_then(|q| serde_json::from_str(q).ok());
    identity
}

impl Authenticator {
    /// The identity a made key proves (read from the database on every request, so a
    /// revocation on any gateway takes effect at the next request).
    pub(super) async fn made_key(&self, secret: &str) -> Result<Identity, AuthError> {
        let now = now_ms();
        let key = match self.store.key_by_hash(&hash_hex(secret), now).await {
            Ok(Some(key)) => key,
            Ok(None) => return Err(AuthError::Invalid("no such key (revoked, expired, or never made)".into())),
            Err(e) => return Err(AuthError::Unavailable(e.to_string())),
        };
        if self.made.due(&key.id, now)
            && let Err(e) = self.store.key_used(&key.id, now).await
        {
            tracing::debug!(error = %e, "could not note a key's use");
        }
        Ok(identity_of(&key))
    }

    /// Makes a key.
    pub async fn make_key(&self, new: NewKey) -> Result<MadeKey, StoreError> {
        use base64::Engine;
        use ring::rand::SecureRandom;
        let random = ring::rand::SystemRandom::new();
        let (mut secret, mut id) = ([0u8; 32], [0u8; 8]);
        random.fill(&mut secret).expect("the system's random source works");
        random.fill(&mut id).expect("the system's random source works");
        let secret = format!("{MADE_KEY_PREFIX}{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret));
        let key = StoredKey {
            id: hex(&id),
            name: new.name,
            admin: new.admin,
            quotas: new.quotas.map(|q| serde_json::to_string(&q).expect("quotas serialize")),
            created_at: now_ms(),
            expires_at: new.expires_at,
            last_used_at: None,
        };
        self.store.create_key(&key, &hash_hex(&secret)).await?;
        Ok(MadeKey { secret, key })
    }

    /// Ends the session whose id hashes to `id_hash` (a sign-out): everywhere at once, and the
    /// streams it opened here at once (on the other gateways at their next look).
    pub async fn end_session(&self, id_hash: &str) -> Result<(), StoreError> {
        self.store.end_session(id_hash).await?;
        self.grants.end_session(id_hash, "signed out");
        Ok(())
    }

    /// Ends every session of `subject`, as [`Authenticator::end_session`] ends one; how many.
    pub async fn end_sessions_of(&self, subject: &str) -> Result<u64, StoreError> {
        let ended = self.store.end_sessions_of(subject).await?;
        self.grants.end_sessions_of(subject, "an administrator ended your sessions");
        Ok(ended)
    }

    /// Revokes a made key: it is refused from now on, on every gateway, and what it opened ends
    /// (here at once; on the other gateways at their next look, see `grants.rs`). False: no
    /// such key.
    pub async fn revoke_key(&self, id: &str) -> Result<bool, StoreError> {
        let removed = self.store.revoke_key(id).await?;
        self.grants.end_credential(&format!("{KEY_SUBJECT_PREFIX}{id}"), "the key was revoked");
        Ok(removed)
    }
}
