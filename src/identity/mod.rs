//! Who a request comes from (docs/identity.md): a configured API key (an administrator), a key
//! made at runtime (`dk_...`, `POST /keys`), a signed token (its `sub` is the subject; `scope`
//! with `dispatch:admin` makes an administrator), or the session cookie a browser got for one
//! of those. With neither keys nor token keys configured, auth is off and every request is the
//! one anonymous administrator.
//!
//! Every credential is checked from the request's head: the layer that calls
//! [`Authenticator::identify`] runs before any byte of the body is read.

mod grants;
mod jwks;
mod keys;
mod quotas;
mod tokens;

use std::sync::Arc;

use ring::digest::{SHA256, digest};
use subtle::ConstantTimeEq;

pub use grants::{Grants, Held};
pub use keys::{MADE_KEY_PREFIX, MadeKey, NewKey};
pub use quotas::{QuotaError, QuotaExceeded, StreamPlace, StreamQuota, turn_budget};

use crate::config::{Config, Quotas};
use crate::store::{Store, StoreError, StoredSession};

/// Scope that makes a token's subject an administrator.
pub const ADMIN_SCOPE: &str = "dispatch:admin";

/// What an API key's subject begins with (`key:<hash prefix>`): a token's `sub` may not.
pub const KEY_SUBJECT_PREFIX: &str = "key:";

/// How long a session begun with an API key lasts (a token's session ends at its `exp`).
pub const KEY_SESSION_SECS: u64 = 12 * 60 * 60;

/// Why a token was refused.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("the token has expired")]
    Expired,
    #[error("the token is not valid yet")]
    NotYet,
    #[error("the token's signature does not verify")]
    Signature,
    #[error("the token's `alg` {0} is not one this gateway takes")]
    Algorithm(String),
    #[error("the token's issuer is not --jwt-issuer")]
    Issuer,
    #[error("the token's audience is not --jwt-audience")]
    Audience,
    #[error("the token names no key this gateway knows (`kid` {0:?})")]
    UnknownKey(Option<String>),
    #[error("the token's signing keys cannot be fetched now: {0}")]
    KeysUnavailable(String),
    #[error("the token lacks a claim it needs: {0}")]
    Claim(String),
    #[error("the token is malformed")]
    Malformed,
}

/// Who a request comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The token's `sub`; `key:<hash prefix>` for an API key; `anonymous` with auth off.
    pub subject: Arc<str>,
    /// Sees and may do everything, has no quota.
    pub admin: bool,
    /// When the credential stops being valid (Unix seconds): a token's `exp`; none for a key.
    pub expires_at: Option<u64>,
    /// Auth is off: the subject owns nothing (what it creates has no owner).
    pub anonymous: bool,
    /// What proved it, so that taking that back ends what it opened: `key:<id>` (a made key),
    /// `api-key:<hash prefix>` (a configured key), `token:<kid>` (a signed token; `token:`
    /// when a configured key checked it); empty with auth off.
    pub credential: Arc<str>,
    /// The session (the hash of its id) when the cookie proved it.
    pub session: Option<Arc<str>>,
    /// Quotas that replace the configured ones for this identity (a made key's).
    pub quotas: Option<Quotas>,
}

impl Identity {
    /// A signed-in identity, proved by `credential`.
    pub fn signed(subject: Arc<str>, admin: bool, expires_at: Option<u64>, credential: Arc<str>) -> Identity {
        Identity { subject, admin, expires_at, anonymous: false, credential, session: None, quotas: None }
    }

    /// The identity a request with this session's cookie has.
    fn of_session(session: StoredSession, id_hash: &str) -> Identity {
        let mut identity = Identity::signed(
            Arc::from(session.subject.as_str()),
            session.admin,
            Some((session.expires_at / 1000).max(0) as u64),
            Arc::from(session.credential.as_str()),
        );
        identity.session = Some(Arc::from(id_hash));
        identity.quotas = session.quotas.as_deref().and_then(|q| serde_json::from_str(q).ok());
        identity
    }

    /// The quotas this identity's turns and streams count against.
    pub fn quotas<'a>(&'a self, configured: &'a Quotas) -> &'a Quotas {
        self.quotas.as_ref().unwrap_or(configured)
    }
}

impl Identity {
    /// The identity of every request while auth is off (made once: a clone is a reference
    /// count, on every request).
    pub fn anonymous() -> Identity {
        static ANONYMOUS: std::sync::LazyLock<Identity> = std::sync::LazyLock::new(|| Identity {
            subject: Arc::from("anonymous"),
            admin: true,
            expires_at: None,
            anonymous: true,
            credential: Arc::from(""),
            session: None,
            quotas: None,
        });
        ANONYMOUS.clone()
    }

    /// Whether this identity may see a conversation owned by `owner` (`None`: no owner, as
    /// conversations from before identities or from a gateway with auth off).
    pub fn may_see(&self, owner: Option<&str>) -> bool {
        self.admin || owner == Some(&*self.subject)
    }

    /// The owner stored for a conversation this identity creates.
    pub fn owner(&self) -> Option<&str> {
        (!self.anonymous).then_some(&*self.subject)
    }

    /// The subject whose conversations alone this identity sees; `None` for an administrator.
    pub fn viewer(&self) -> Option<&Arc<str>> {
        (!self.admin).then_some(&self.subject)
    }
}

/// Why a credential was refused: each says so in the 401's error.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("this route needs an API key or a token (Authorization: Bearer, ?access_token= or the session cookie)")]
    Missing,
    #[error("the API key or token is not valid: {0}")]
    Invalid(String),
    #[error("the credential cannot be checked now: {0}")]
    Unavailable(String),
}

/// Checks API keys, made keys, tokens and sessions, and keeps what they opened (`grants`).
pub struct Authenticator {
    /// SHA-256 of each configured API key, with its subject and credential.
    keys: Vec<([u8; 32], Arc<str>, Arc<str>)>,
    tokens: Option<tokens::Tokens>,
    /// Where made keys and sessions are kept.
    store: Store,
    /// Made keys' last use, written at most once a minute per key.
    made: keys::LastUse,
    /// The live streams each credential opened, to end when it is taken back.
    pub grants: Arc<Grants>,
}

impl Authenticator {
    /// From the configuration: reads the token keys' files (a missing or bad one stops the
    /// start) and begins fetching the JWKS, if any.
    pub fn new(config: &Config, store: Store) -> Result<Arc<Authenticator>, String> {
        let keys = config
            .api_keys
            .iter()
            .map(|key| {
                let hash: [u8; 32] = digest(&SHA256, key.as_bytes()).as_ref().try_into().expect("32 bytes");
                let subject = format!("{KEY_SUBJECT_PREFIX}{}", hex(&hash[..4]));
                let credential = format!("{CONFIGURED_KEY_PREFIX}{}", hex(&hash[..8]));
                (hash, Arc::from(subject), Arc::from(credential))
            })
            .collect();
        let auth = Arc::new(Authenticator {
            keys,
            tokens: tokens::Tokens::new(config)?,
            store,
            made: keys::LastUse::default(),
            grants: Arc::default(),
        });
        if auth.enabled()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(grants::sweep(Arc::downgrade(&auth)));
        }
        Ok(auth)
    }

    /// Whether requests need a credential.
    pub fn enabled(&self) -> bool {
        !self.keys.is_empty() || self.tokens.is_some()
    }

    /// Whether signed tokens are taken.
    pub fn takes_tokens(&self) -> bool {
        self.tokens.is_some()
    }

    /// The identity `credential` (a key or a token) proves.
    pub async fn identify(&self, credential: &str) -> Result<Identity, AuthError> {
        if credential.is_empty() {
            return Err(AuthError::Missing);
        }
        if let Some((subject, proof)) = self.key(credential.as_bytes()) {
            return Ok(Identity::signed(subject, true, None, proof));
        }
        if credential.starts_with(MADE_KEY_PREFIX) {
            return self.made_key(credential).await;
        }
        match &self.tokens {
            Some(tokens) if credential.bytes().filter(|b| *b == b'.').count() == 2 => {
                tokens.verify(credential).await.map_err(|e| AuthError::Invalid(e.to_string()))
            }
            Some(_) => Err(AuthError::Invalid("neither a key nor a token".into())),
            None => Err(AuthError::Invalid("not a key".into())),
        }
    }

    /// The subject of the key `presented` is, compared in a time that depends on neither where
    /// the inputs differ nor their lengths: both sides are hashed to 32 bytes, then compared in
    /// constant time against every key (no early exit at a match).
    fn key(&self, presented: &[u8]) -> Option<(Arc<str>, Arc<str>)> {
        let presented = digest(&SHA256, presented);
        let mut found = None;
        for (hash, subject, credential) in &self.keys {
            if bool::from(hash.ct_eq(presented.as_ref())) {
                found = Some((subject.clone(), credential.clone()));
            }
        }
        found
    }

    /// The identity of the session whose id hashes to `id_hash`: none when it ended, or when
    /// the credential that made it was taken back (a configured key no longer configured, a
    /// key the JWKS withdrew; a made key's revocation removes its sessions).
    pub async fn session(&self, id_hash: &str) -> Result<Option<Identity>, StoreError> {
        let Some(session) = self.store.session(id_hash, crate::store::now_ms()).await? else { return Ok(None) };
        let identity = Identity::of_session(session, id_hash);
        Ok(self.credential_live(&identity.credential).then_some(identity))
    }

    /// Whether a credential of this gateway's own checking (configured keys, token keys) still
    /// stands; made keys and sessions are the database's to say.
    pub fn credential_live(&self, credential: &str) -> bool {
        if credential.starts_with(CONFIGURED_KEY_PREFIX) {
            return self.keys.iter().any(|(_, _, c)| &**c == credential);
        }
        match &self.tokens {
            Some(tokens) if credential.starts_with(tokens::TOKEN_PREFIX) => tokens.key_live(credential),
            None if credential.starts_with(tokens::TOKEN_PREFIX) => false,
            _ => true,
        }
    }
}

/// What a configured key's credential begins with (then a prefix of its SHA-256).
const CONFIGURED_KEY_PREFIX: &str = "api-key:";

/// What the store keeps of a session's id: its SHA-256, in hex.
pub fn session_hash(id: &str) -> String {
    hex(digest(&SHA256, id.as_bytes()).as_ref())
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn with_keys(keys: &[&str]) -> (Arc<Authenticator>, crate::store::testing::TestStore) {
        let mut config = Config::defaults();
        config.api_keys = keys.iter().map(|k| (*k).to_owned()).collect();
        let t = crate::store::testing::every_backend().await.remove(0);
        (Authenticator::new(&config, t.store.clone()).unwrap(), t)
    }

    #[tokio::test]
    async fn keys_compare_exactly_and_are_administrators() {
        let (auth, _store) = with_keys(&["secret", "other"]).await;
        let one = auth.identify("secret").await.unwrap();
        assert!(one.admin && one.subject.starts_with("key:"));
        let two = auth.identify("other").await.unwrap();
        assert_ne!(one.subject, two.subject, "each key is its own subject");
        for bad in ["secreT", "secret2", "", "a.b.c"] {
            assert!(auth.identify(bad).await.is_err(), "{bad}");
        }
        assert!(!with_keys(&[]).await.0.enabled());
    }

    #[test]
    fn users_see_their_own() {
        let alice = Identity::signed(Arc::from("alice"), false, None, Arc::from("token:"));
        assert!(alice.may_see(Some("alice")));
        assert!(!alice.may_see(Some("bob")));
        assert!(!alice.may_see(None), "a conversation with no owner is the administrators'");
        assert!(Identity::anonymous().may_see(Some("bob")));
        assert_eq!(Identity::anonymous().owner(), None);
    }
}
