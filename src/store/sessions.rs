//! Browser sessions (docs/identity.md): the cookie's value is a random id the gateway made; only its
//! SHA-256 is stored, with who signed in and until when. Kept in the database so that every
//! gateway of a cluster honours a session, and `DELETE /auth/session` ends it everywhere.

use super::sql::Query;
use super::{Store, StoreResult};

/// A session as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSession {
    pub subject: String,
    pub admin: bool,
    /// Unix ms.
    pub expires_at: i64,
}

impl Store {
    /// Records a session under `id_hash`, and removes the sessions that have ended.
    pub async fn begin_session(&self, id_hash: &str, session: &StoredSession, now: i64) -> StoreResult<()> {
        self.execute(Query::new("DELETE FROM sessions WHERE expires_at < $1").bind(now)).await?;
        let sql = "INSERT INTO sessions (id_hash, subject, admin, expires_at) VALUES ($1, $2, $3, $4)";
        let q = Query::new(sql)
            .bind(id_hash)
            .bind(session.subject.as_str())
            .bind(i64::from(session.admin))
            .bind(session.expires_at);
        self.execute(q).await?;
        Ok(())
    }

    /// The session under `id_hash`, unless it has ended.
    pub async fn session(&self, id_hash: &str, now: i64) -> StoreResult<Option<StoredSession>> {
        let sql = "SELECT subject, admin, expires_at FROM sessions WHERE id_hash = $1 AND expires_at > $2";
        let row: Option<(String, i64, i64)> = self.fetch_optional(Query::new(sql).bind(id_hash).bind(now)).await?;
        Ok(row.map(|(subject, admin, expires_at)| StoredSession { subject, admin: admin != 0, expires_at }))
    }

    /// Ends the session under `id_hash` (false: there was none).
    pub async fn end_session(&self, id_hash: &str) -> StoreResult<bool> {
        Ok(self.execute(Query::new("DELETE FROM sessions WHERE id_hash = $1").bind(id_hash)).await? > 0)
    }
}
