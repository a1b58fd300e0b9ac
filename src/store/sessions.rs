//! Browser sessions (docs/identity.md): the cookie's value is a random id the gateway made; only its
//! SHA-256 is stored, with who signed in, with what credential, and until when. Kept in the
//! database so that every gateway of a cluster honours a session, and ending it (a sign-out,
//! `DELETE /auth/sessions?subject=`, the key that made it revoked) ends it everywhere.

use super::sql::Query;
use super::{Store, StoreResult};

/// A session as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSession {
    pub subject: String,
    pub admin: bool,
    /// Unix ms.
    pub expires_at: i64,
    /// What made it: `key:<id>` (a made key), `api-key:<hash prefix>` (a configured key),
    /// `token:<kid>` (a signed token; `token:` for a key without an id).
    pub credential: String,
    /// The quotas of the credential, as JSON, when they replace the configured ones.
    pub quotas: Option<String>,
}

/// The sessions a revoked made key opened stop working with its row: a lookup checks that it is
/// there (so no window is left between removing the key and its sessions).
const SESSION_ALIVE: &str = "(credential NOT LIKE 'key:%'
     OR EXISTS (SELECT 1 FROM api_keys k WHERE 'key:' || k.id = sessions.credential))";

impl Store {
    /// Records a session under `id_hash`, and removes the sessions that have ended.
    pub async fn begin_session(&self, id_hash: &str, session: &StoredSession, now: i64) -> StoreResult<()> {
        self.execute(Query::new("DELETE FROM sessions WHERE expires_at < $1").bind(now)).await?;
        let sql = "INSERT INTO sessions (id_hash, subject, admin, expires_at, credential, quotas)
                   VALUES ($1, $2, $3, $4, $5, $6)";
        let q = Query::new(sql)
            .bind(id_hash)
            .bind(session.subject.as_str())
            .bind(i64::from(session.admin))
            .bind(session.expires_at)
            .bind(session.credential.as_str())
            .bind(session.quotas.as_deref());
        self.execute(q).await?;
        Ok(())
    }

    /// The session under `id_hash`, unless it has ended.
    pub async fn session(&self, id_hash: &str, now: i64) -> StoreResult<Option<StoredSession>> {
        let sql = format!(
            "SELECT subject, admin, expires_at, credential, quotas FROM sessions
             WHERE id_hash = $1 AND expires_at > $2 AND {SESSION_ALIVE}"
        );
        let row: Option<(String, i64, i64, String, Option<String>)> =
            self.fetch_optional(Query::new(sql).bind(id_hash).bind(now)).await?;
        Ok(row.map(|(subject, admin, expires_at, credential, quotas)| StoredSession {
            subject,
            admin: admin != 0,
            expires_at,
            credential,
            quotas,
        }))
    }

    /// Ends the session under `id_hash` (false: there was none).
    pub async fn end_session(&self, id_hash: &str) -> StoreResult<bool> {
        Ok(self.execute(Query::new("DELETE FROM sessions WHERE id_hash = $1").bind(id_hash)).await? > 0)
    }

    /// Ends every session of `subject`; how many there were.
    pub async fn end_sessions_of(&self, subject: &str) -> StoreResult<u64> {
        self.execute(Query::new("DELETE FROM sessions WHERE subject = $1").bind(subject)).await
    }

    /// Which of the sessions under `id_hashes` still work at `now`.
    pub async fn live_sessions(&self, id_hashes: &[&str], now: i64) -> StoreResult<Vec<String>> {
        let sql =
            format!("SELECT id_hash FROM sessions WHERE expires_at > $1 AND id_hash IN ({{list}}) AND {SESSION_ALIVE}");
        self.found_among(&sql, now, id_hashes).await
    }
}
