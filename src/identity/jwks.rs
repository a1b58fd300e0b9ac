//! The keys of a JWKS URL: fetched at start, read again every `--jwks-refresh-secs` (sooner when
//! the answer's `Cache-Control: max-age` says so, never more often than every 10 s), so that a
//! key withdrawn from the set is refused from the next read on; and fetched again when a token
//! names a `kid` the cache lacks (a rotation), at most once a minute (once every 5 s while
//! fetches fail), so that tokens with made-up `kid`s cannot make the gateway hammer the identity
//! provider. A fetch is bounded in time (5 s) and size (`--jwks-max-bytes`); only public keys
//! (RSA, EC P-256) are taken from it.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey};

use super::TokenError;
use crate::runtime::http_client::HttpClient;

const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(5);
/// The shortest wait between periodic reads, whatever `max-age` says.
const SHORTEST_REFRESH: Duration = Duration::from_secs(10);

type Keys = HashMap<String, (DecodingKey, Algorithm)>;

pub(super) struct Jwks {
    url: http::Uri,
    client: HttpClient,
    max_bytes: usize,
    /// Between fetches a token's unknown `kid` may cause (a minute).
    refetch_after: Duration,
    keys: RwLock<Arc<Keys>>,
    /// Between periodic reads (`--jwks-refresh-secs`).
    refresh_every: Duration,
    /// The last answer's `Cache-Control: max-age`, in seconds (0: none).
    max_age: std::sync::atomic::AtomicU64,
    /// Held while fetching; when the last fetch ended, and whether it failed (why).
    fetching: tokio::sync::Mutex<Option<(Instant, Option<String>)>>,
}

impl Jwks {
    /// Checks the URL and starts the first fetch (a JWKS that is down does not stop the start:
    /// tokens are refused until it answers).
    pub(super) fn start(
        url: &str,
        max_bytes: usize,
        refetch_after: Duration,
        refresh_every: Duration,
    ) -> Result<Arc<Jwks>, String> {
        let uri: http::Uri = url.parse().map_err(|e| format!("--jwks-url {url:?}: {e}"))?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
            return Err(format!("--jwks-url {url:?}: an http:// or https:// URL"));
        }
        let client = HttpClient::new(&uri, FETCH_TIMEOUT).map_err(|e| format!("--jwks-url: {e}"))?;
        let jwks = Arc::new(Jwks {
            url: uri,
            client,
            max_bytes,
            refetch_after,
            keys: RwLock::default(),
            refresh_every,
            max_age: Default::default(),
            fetching: tokio::sync::Mutex::new(None),
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(Jwks::keep_fresh(Arc::downgrade(&jwks)));
        }
        Ok(jwks)
    }

    /// Reads the set at start, then again and again for as long as the gateway takes tokens.
    async fn keep_fresh(jwks: std::sync::Weak<Jwks>) {
        loop {
            let wait = {
                let Some(jwks) = jwks.upgrade() else { return };
                jwks.refresh(true).await;
                let max_age = jwks.max_age.load(std::sync::atomic::Ordering::Relaxed);
                let wait =
                    if max_age > 0 { jwks.refresh_every.min(Duration::from_secs(max_age)) } else { jwks.refresh_every };
                wait.max(SHORTEST_REFRESH.min(jwks.refresh_every))
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// Whether the set, as last read, still has the key `kid`.
    pub(super) fn knows(&self, kid: &str) -> bool {
        self.keys.read().unwrap_or_else(|p| p.into_inner()).contains_key(kid)
    }

    /// The key `kid` names, for a token signed with `alg`.
    pub(super) async fn key(&self, kid: &str, alg: Algorithm) -> Result<DecodingKey, TokenError> {
        if let Some(found) = self.cached(kid, alg) {
            return found;
        }
        if let Some(failure) = self.refresh(false).await {
            return Err(TokenError::KeysUnavailable(failure));
        }
        self.cached(kid, alg).unwrap_or_else(|| Err(TokenError::UnknownKey(Some(kid.to_owned()))))
    }

    fn cached(&self, kid: &str, alg: Algorithm) -> Option<Result<DecodingKey, TokenError>> {
        let keys = self.keys.read().unwrap_or_else(|p| p.into_inner()).clone();
        let (key, key_alg) = keys.get(kid)?;
        Some(if *key_alg == alg { Ok(key.clone()) } else { Err(TokenError::Algorithm(format!("{alg:?}"))) })
    }

    /// Fetches the set again unless the last fetch was too recent (`force`: the first one);
    /// waits for a fetch in progress. Returns why the keys are unavailable, when the last
    /// fetch failed.
    async fn refresh(&self, force: bool) -> Option<String> {
        let mut last = self.fetching.lock().await;
        if let Some((at, failure)) = &*last {
            let wait = if failure.is_some() { RETRY_AFTER_FAILURE.min(self.refetch_after) } else { self.refetch_after };
            if !force && at.elapsed() < wait {
                return failure.clone();
            }
        }
        let failure = match tokio::time::timeout(FETCH_TIMEOUT, self.fetch()).await {
            Ok(Ok(keys)) => {
                tracing::info!(url = %self.url, keys = keys.len(), "fetched the JWKS");
                *self.keys.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(keys);
                None
            }
            Ok(Err(e)) => Some(e),
            Err(_) => Some(format!("no answer within {} s", FETCH_TIMEOUT.as_secs())),
        };
        if let Some(e) = &failure {
            tracing::warn!(url = %self.url, error = %e, "cannot fetch the JWKS; tokens it signs are refused meanwhile");
        }
        *last = Some((Instant::now(), failure.clone()));
        failure
    }

    async fn fetch(&self) -> Result<Keys, String> {
        let request = http::Request::get(self.url.clone())
            .header(http::header::ACCEPT, "application/json")
            .header(http::header::HOST, self.url.authority().map_or("", |a| a.as_str()))
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let response = self.client.send(request).await.map_err(|e| format!("cannot reach it: {e}"))?;
        if !response.status().is_success() {
            return Err(format!("it answered {}", response.status()));
        }
        let max_age = response
            .headers()
            .get_all(http::header::CACHE_CONTROL)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .find_map(|d| d.trim().strip_prefix("max-age=").and_then(|s| s.trim().parse::<u64>().ok()))
            .unwrap_or(0);
        self.max_age.store(max_age, std::sync::atomic::Ordering::Relaxed);
        let body = Limited::new(response.into_body(), self.max_bytes)
            .collect()
            .await
            .map_err(|_| format!("larger than --jwks-max-bytes ({} bytes), or cut", self.max_bytes))?
            .to_bytes();
        let set: JwkSet = serde_json::from_slice(&body).map_err(|e| format!("not a JWKS: {e}"))?;
        let mut keys = Keys::new();
        for jwk in &set.keys {
            let Some(kid) = &jwk.common.key_id else { continue };
            // Public keys only: a symmetric key in a published set would let anyone who read
            // the set sign tokens.
            let alg = match &jwk.algorithm {
                AlgorithmParameters::RSA(_) => Algorithm::RS256,
                AlgorithmParameters::EllipticCurve(p) if p.curve == EllipticCurve::P256 => Algorithm::ES256,
                _ => continue,
            };
            if let Ok(key) = DecodingKey::from_jwk(jwk) {
                keys.insert(kid.clone(), (key, alg));
            }
        }
        Ok(keys)
    }
}
