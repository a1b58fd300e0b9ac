//! Signed tokens (JWT): which key checks a token, and what its claims must say.
//!
//! The key is chosen by the gateway's configuration and the token's `alg`, never by the token
//! alone: an HS256 token is checked only with `--jwt-secret-file`'s secret, an RS256 or ES256
//! one only with a public key of that type (`--jwt-public-key-file`, or the JWKS key its
//! `kid` names). So `alg: none` has no key, and an HS256 token "signed" with the public key's
//! bytes (key confusion) is checked against the secret, or refused when there is none.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;

use super::jwks::Jwks;
use super::{ADMIN_SCOPE, Identity, TokenError};
use crate::config::Config;

/// What a token's credential begins with (then the `kid` of the JWKS key that checked it).
pub(super) const TOKEN_PREFIX: &str = "token:";

/// Clock skew allowed on `exp`, `nbf` and `iat`, in seconds.
const LEEWAY_SECS: u64 = 30;

/// The claims the gateway reads.
#[derive(Debug, Deserialize)]
struct Claims {
    /// Required (checked by the validation too; optional here so that its absence is said).
    #[serde(default)]
    sub: Option<String>,
    #[serde(default)]
    exp: Option<u64>,
    #[serde(default)]
    iat: Option<u64>,
    #[serde(default)]
    scope: Option<String>,
}

pub(super) struct Tokens {
    /// Tokens verified lately: a client sends the same one with every request.
    verified: Verified,
    secret: Option<DecodingKey>,
    /// The public key and the one algorithm its type signs with.
    public: Option<(DecodingKey, Algorithm)>,
    jwks: Option<Arc<Jwks>>,
    issuer: Option<String>,
    audience: Option<String>,
}

impl Tokens {
    /// `None` when no token key is configured.
    pub(super) fn new(config: &Config) -> Result<Option<Tokens>, String> {
        let secret = match &config.jwt_secret_file {
            Some(path) => {
                let mut bytes = read(path, "--jwt-secret-file")?;
                if bytes.last() == Some(&b'\n') {
                    bytes.pop();
                }
                if bytes.len() < 32 {
                    return Err(format!(
                        "--jwt-secret-file {}: an HS256 secret needs at least 32 bytes",
                        path.display()
                    ));
                }
                Some(DecodingKey::from_secret(&bytes).map_err(|e| format!("--jwt-secret-file: {e}"))?)
            }
            None => None,
        };
        let public = match &config.jwt_public_key_file {
            Some(path) => Some(
                public_key(&read(path, "--jwt-public-key-file")?)
                    .map_err(|e| format!("--jwt-public-key-file {}: {e}", path.display()))?,
            ),
            None => None,
        };
        let jwks = match &config.jwks_url {
            Some(url) => Some(Jwks::start(
                url,
                config.jwks_max_bytes as usize,
                std::time::Duration::from_secs(config.jwks_refetch_secs),
                std::time::Duration::from_secs(config.jwks_refresh_secs),
            )?),
            None => None,
        };
        if secret.is_none() && public.is_none() && jwks.is_none() {
            return Ok(None);
        }
        Ok(Some(Tokens {
            verified: Verified::new(config.token_cache_bytes as usize),
            secret,
            public,
            jwks,
            issuer: config.jwt_issuer.clone(),
            audience: config.jwt_audience.clone(),
        }))
    }

    /// The identity a valid token proves: remembered for a minute at most (never past its
    /// `exp`), so that the signature of a client's token is checked once, not per request.
    pub(super) async fn verify(&self, token: &str) -> Result<Identity, TokenError> {
        let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
        let key: [u8; 32] = digest.as_ref().try_into().expect("32 bytes");
        // A remembered token signed by a key the JWKS no longer has is checked again (and
        // refused): a withdrawn key takes effect at the set's next read.
        if let Some(identity) = self.verified.get(&key)
            && self.key_live(&identity.credential)
        {
            return Ok(identity);
        }
        let identity = self.check(token).await?;
        self.verified.put(key, &identity);
        Ok(identity)
    }

    /// Whether the key behind a token's `credential` (`token:<kid>`) is still trusted: a JWKS
    /// key while the set has it; the configured secret or public key while the gateway runs.
    pub(super) fn key_live(&self, credential: &str) -> bool {
        match (credential.strip_prefix(TOKEN_PREFIX), &self.jwks) {
            (Some(kid), Some(jwks)) if !kid.is_empty() => jwks.knows(kid),
            _ => true,
        }
    }

    async fn check(&self, token: &str) -> Result<Identity, TokenError> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| TokenError::Malformed)?;
        let key = match header.alg {
            Algorithm::HS256 => self.secret.clone().ok_or(TokenError::Algorithm("HS256".into()))?,
            alg @ (Algorithm::RS256 | Algorithm::ES256) => match (&self.public, &self.jwks, &header.kid) {
                (_, Some(jwks), Some(kid)) => jwks.key(kid, alg).await?,
                (Some((key, public_alg)), _, _) if *public_alg == alg => key.clone(),
                (_, Some(_), None) => return Err(TokenError::UnknownKey(None)),
                _ => return Err(TokenError::Algorithm(format!("{alg:?}"))),
            },
            other => return Err(TokenError::Algorithm(format!("{other:?}"))),
        };
        let mut validation = Validation::new(header.alg);
        validation.leeway = LEEWAY_SECS;
        validation.validate_nbf = true;
        validation.required_spec_claims = HashSet::from(["exp".to_owned(), "sub".to_owned()]);
        if let Some(issuer) = &self.issuer {
            validation.set_issuer(&[issuer]);
            validation.required_spec_claims.insert("iss".into());
        }
        match &self.audience {
            Some(audience) => {
                validation.set_audience(&[audience]);
                validation.required_spec_claims.insert("aud".into());
            }
            None => validation.validate_aud = false,
        }
        let claims = jsonwebtoken::decode::<Claims>(token, &key, &validation).map_err(refusal)?.claims;
        if claims.iat.is_some_and(|iat| iat > jsonwebtoken::get_current_timestamp() + LEEWAY_SECS) {
            return Err(TokenError::NotYet);
        }
        let Some(exp) = claims.exp else { return Err(TokenError::Claim("exp".into())) };
        let Some(sub) = claims.sub.filter(|s| !s.is_empty()) else { return Err(TokenError::Claim("sub".into())) };
        // Subjects are namespaced by kind: `key:` names API keys, which no token may speak for.
        if sub.starts_with(super::KEY_SUBJECT_PREFIX) {
            return Err(TokenError::Claim(format!(
                "sub: a token's subject cannot begin with `{}`, which names API keys",
                super::KEY_SUBJECT_PREFIX
            )));
        }
        let admin = claims.scope.as_deref().is_some_and(|s| s.split(' ').any(|s| s == ADMIN_SCOPE));
        // The key's id only when the JWKS checked it (a configured key has none to withdraw).
        let kid = if self.jwks.is_some() && matches!(header.alg, Algorithm::RS256 | Algorithm::ES256) {
            header.kid.as_deref().unwrap_or_default()
        } else {
            ""
        };
        Ok(Identity::signed(Arc::from(sub), admin, Some(exp), Arc::from(format!("{TOKEN_PREFIX}{kid}"))))
    }
}

fn read(path: &Path, flag: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{flag} {}: cannot be read: {e}", path.display()))
}

/// A PEM public key and the algorithm its type signs with: RSA keys RS256, EC keys ES256.
fn public_key(pem: &[u8]) -> Result<(DecodingKey, Algorithm), String> {
    let text = std::str::from_utf8(pem).map_err(|_| "not a PEM file".to_owned())?;
    if text.contains("PRIVATE KEY") {
        return Err("a private key: give the public key only".into());
    }
    if let Ok(key) = DecodingKey::from_rsa_pem(pem) {
        return Ok((key, Algorithm::RS256));
    }
    if let Ok(key) = DecodingKey::from_ec_pem(pem) {
        return Ok((key, Algorithm::ES256));
    }
    Err("neither an RSA nor an EC (P-256) public key in PEM".into())
}

fn refusal(e: jsonwebtoken::errors::Error) -> TokenError {
    use jsonwebtoken::errors::ErrorKind as K;
    match e.kind() {
        K::ExpiredSignature => TokenError::Expired,
        K::ImmatureSignature => TokenError::NotYet,
        K::InvalidSignature | K::InvalidEcdsaKey | K::InvalidRsaKey(_) => TokenError::Signature,
        K::InvalidIssuer => TokenError::Issuer,
        K::InvalidAudience => TokenError::Audience,
        K::InvalidAlgorithm | K::MissingAlgorithm | K::InvalidAlgorithmName => TokenError::Algorithm("?".into()),
        K::MissingRequiredClaim(claim) => TokenError::Claim(claim.clone()),
        K::InvalidClaimFormat(claim) => TokenError::Claim(claim.clone()),
        _ => TokenError::Malformed,
    }
}

/// How long a verified token is remembered at most (a key that left the JWKS, or a token's
/// `nbf`/`exp` crossed, takes effect within it).
const REMEMBERED: std::time::Duration = std::time::Duration::from_secs(60);

/// Tokens verified lately, by their SHA-256, bounded in bytes (`--token-cache-bytes`): past the
/// bound, all are forgotten at once (each is verified again on its next use).
struct Verified {
    max_bytes: usize,
    /// The bytes held, and each token's identity with when it is to be forgotten.
    entries: std::sync::Mutex<(usize, VerifiedMap)>,
}

type VerifiedMap = std::collections::HashMap<[u8; 32], (Identity, std::time::Instant)>;

impl Verified {
    fn new(max_bytes: usize) -> Verified {
        Verified { max_bytes, entries: std::sync::Mutex::default() }
    }

    fn get(&self, key: &[u8; 32]) -> Option<Identity> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let (identity, until) = entries.1.get(key)?;
        let now = std::time::Instant::now();
        let unexpired = identity.expires_at.is_none_or(|exp| exp > jsonwebtoken::get_current_timestamp());
        (now < *until && unexpired).then(|| identity.clone())
    }

    fn put(&self, key: [u8; 32], identity: &Identity) {
        // The key, the subject, and the map's own share of an entry.
        let size = 32 + identity.subject.len() + 64;
        if size > self.max_bytes {
            return;
        }
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if entries.0 + size > self.max_bytes {
            *entries = Default::default();
        }
        if entries.1.insert(key, (identity.clone(), std::time::Instant::now() + REMEMBERED)).is_none() {
            entries.0 += size;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn someone(expires_at: u64) -> Identity {
        Identity::signed(Arc::from("alice"), false, Some(expires_at), Arc::from("token:"))
    }

    #[test]
    fn a_remembered_token_is_forgotten_at_its_exp_and_the_memory_stays_within_its_bytes() {
        let now = jsonwebtoken::get_current_timestamp();
        let verified = Verified::new(1000);
        verified.put([1; 32], &someone(now + 600));
        assert_eq!(verified.get(&[1; 32]), Some(someone(now + 600)));
        verified.put([2; 32], &someone(now - 1));
        assert_eq!(verified.get(&[2; 32]), None, "past its exp: verified again, and refused");
        for i in 0..100u8 {
            verified.put([i; 32], &someone(now + 600));
        }
        assert!(verified.entries.lock().unwrap().0 <= 1000);
        assert!(Verified::new(0).get(&[1; 32]).is_none());
    }
}
