//! Every message on the bus is signed, and a gateway takes only what is signed with the
//! cluster's key (issue: a plain NATS client with publish rights could otherwise publish a
//! whole turn that watchers render, forge status changes, or stop a turn).
//!
//! The key is made by the first gateway that joins and kept in the database every gateway of a
//! cluster shares (`bus_secret`): whoever reaches the database already holds everything the
//! bus carries, and nobody configures a secret. The signature is an HMAC-SHA256 over the
//! subject, the headers that say whose message it is and when it was sent, and the payload,
//! each part length-prefixed so that no two messages sign alike. Status changes and control
//! requests (plain NATS, news only while they happen) also carry when they were sent and are
//! refused past `FRESH`, so that one seen on the wire cannot be played again later; turn events
//! are read again by design (catch-up) and are idempotent by their index.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use async_nats::HeaderMap;
use ring::hmac;

use super::{INDEX, NODE, PART, TURN, hex};

const SIGNATURE: &str = "Dispatch-Signature";
const SENT: &str = "Dispatch-Sent";

/// How old (or how far ahead of this gateway's clock) a status change or control request may
/// be: the bus's own delays, and clocks a little apart.
const FRESH: Duration = Duration::from_secs(120);

/// The headers a signature covers, besides the subject and payload.
const SIGNED: [&str; 5] = [NODE, TURN, INDEX, PART, SENT];

/// Signs and checks bus messages with the cluster's key.
pub(super) struct Signer {
    key: hmac::Key,
}

impl Signer {
    pub(super) fn new(secret: &[u8]) -> Signer {
        Signer { key: hmac::Key::new(hmac::HMAC_SHA256, secret) }
    }

    fn context(&self, subject: &str, headers: &HeaderMap, payload: &[u8]) -> hmac::Context {
        let mut context = hmac::Context::with_key(&self.key);
        let mut part = |bytes: &[u8]| {
            context.update(&(bytes.len() as u64).to_be_bytes());
            context.update(bytes);
        };
        part(subject.as_bytes());
        for name in SIGNED {
            match headers.get(name) {
                Some(value) => part(value.as_str().as_bytes()),
                // Absent is not empty.
                None => part(b"\xff"),
            }
        }
        part(payload);
        context
    }

    /// Signs a message as it will be sent.
    pub(super) fn sign(&self, subject: &str, headers: &mut HeaderMap, payload: &[u8]) {
        let tag = self.context(subject, headers, payload).sign();
        headers.insert(SIGNATURE, hex(tag.as_ref()).as_str());
    }

    /// Signs a status change or control message, stamped with the time it is sent.
    pub(super) fn sign_fresh(&self, subject: &str, headers: &mut HeaderMap, payload: &[u8]) {
        headers.insert(SENT, crate::store::now_ms().to_string().as_str());
        self.sign(subject, headers, payload);
    }

    /// Whether a message came from a gateway holding the key (the comparison is constant-time).
    pub(super) fn verify(&self, subject: &str, headers: Option<&HeaderMap>, payload: &[u8]) -> bool {
        let Some(headers) = headers else { return false };
        let Some(tag) = headers.get(SIGNATURE).and_then(|t| unhex(t.as_str())) else { return false };
        let expected = self.context(subject, headers, payload).sign();
        subtle::ConstantTimeEq::ct_eq(expected.as_ref(), tag.as_slice()).into()
    }

    /// [`Signer::verify`], and sent within `FRESH` of now.
    pub(super) fn verify_fresh(&self, subject: &str, headers: Option<&HeaderMap>, payload: &[u8]) -> bool {
        let sent = headers.and_then(|h| h.get(SENT)).and_then(|s| s.as_str().parse::<i64>().ok());
        let fresh = sent.is_some_and(|at| (crate::store::now_ms() - at).unsigned_abs() <= FRESH.as_millis() as u64);
        fresh && self.verify(subject, headers, payload)
    }
}

/// Counts a refused message (`dispatch_bus_rejected_total`) and says so: the first, then at
/// each power of two (a stranger who floods the bus does not flood the log).
pub(super) fn reject(metrics: &crate::metrics::Metrics, what: &str, subject: &str) {
    let n = metrics.bus.rejected.fetch_add(1, Relaxed) + 1;
    if n.is_power_of_two() {
        tracing::warn!(
            what,
            subject,
            refused_so_far = n,
            "refused a bus message: not signed with the cluster's key, stale, or not what its subject says"
        );
    }
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect()
}

/// A new key: 32 random bytes, as hex.
pub(super) fn new_secret() -> String {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 32];
    ring::rand::SystemRandom::new().fill(&mut bytes).expect("the system's random numbers");
    hex(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_covers_the_subject_the_headers_and_the_payload() {
        let signer = Signer::new(b"0123456789abcdef0123456789abcdef");
        let mut headers = HeaderMap::new();
        headers.insert(NODE, "n1");
        headers.insert(TURN, "t1");
        headers.insert(INDEX, "0");
        signer.sign("dispatch.events.open.61", &mut headers, b"payload");
        assert!(signer.verify("dispatch.events.open.61", Some(&headers), b"payload"));
        assert!(!signer.verify("dispatch.events.open.62", Some(&headers), b"payload"), "another subject");
        assert!(!signer.verify("dispatch.events.open.61", Some(&headers), b"payloae"), "another payload");
        let mut moved = headers.clone();
        moved.insert(INDEX, "1");
        assert!(!signer.verify("dispatch.events.open.61", Some(&moved), b"payload"), "another index");
        let other = Signer::new(b"another key, as long as the first");
        assert!(!other.verify("dispatch.events.open.61", Some(&headers), b"payload"), "another key");
        assert!(!signer.verify("dispatch.events.open.61", None, b"payload"), "no headers");
        // A signature that is not hex, or cut, or one too long: refused, no panic.
        for bad in ["zz", "abc", "", &"00".repeat(33), "é"] {
            let mut forged = headers.clone();
            forged.insert(SIGNATURE, bad);
            assert!(!signer.verify("dispatch.events.open.61", Some(&forged), b"payload"), "{bad:?}");
        }
        let mut stale = HeaderMap::new();
        stale.insert(SENT, (crate::store::now_ms() - 600_000).to_string().as_str());
        signer.sign("dispatch.status", &mut stale, b"x");
        assert!(signer.verify("dispatch.status", Some(&stale), b"x"));
        assert!(!signer.verify_fresh("dispatch.status", Some(&stale), b"x"), "ten minutes old");
        let mut fresh = HeaderMap::new();
        signer.sign_fresh("dispatch.status", &mut fresh, b"x");
        assert!(signer.verify_fresh("dispatch.status", Some(&fresh), b"x"));
    }
}
