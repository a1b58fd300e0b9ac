//! API keys made at runtime (docs/identity.md): the database keeps each key's SHA-256, never the
//! secret, with its name, whether it is an administrator's, its quotas and its expiry.
//! Revoking removes the row (and the sessions it opened: see `sessions.rs`).

use super::sql::Query;
use super::{Store, StoreResult};

/// A made key as stored (never its secret).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredKey {
    pub id: String,
    pub name: String,
    pub admin: bool,
    /// Quotas as JSON, replacing the configured ones for this key.
    pub quotas: Option<String>,
    /// Unix ms.
    pub created_at: i64,
    pub expires_at: Option<i64>,
    pub last_used_at: Option<i64>,
}

type KeyRow = (String, String, i64, Option<String>, i64, Option<i64>, Option<i64>);

const COLUMNS: &str = "id, name, admin, quotas, created_at, expires_at, last_used_at";

fn key(row: KeyRow) -> StoredKey {
    let (id, name, admin, quotas, created_at, expires_at, last_used_at) = row;
    StoredKey { id, name, admin: admin != 0, quotas, created_at, expires_at, last_used_at }
}

impl Store {
    /// Records a new key under the SHA-256 (hex) of its secret.
    pub async fn create_key(&self, key: &StoredKey, hash: &str) -> StoreResult<()> {
        let sql = "INSERT INTO api_keys (id, name, hash, admin, quotas, created_at, expires_at)
                   VALUES ($1, $2, $3, $4, $5, $6, CAST($7 AS BIGINT))";
        let q = Query::new(sql)
            .bind(key.id.as_str())
            .bind(key.name.as_str())
            .bind(hash)
            .bind(key.admin)
            .bind(key.quotas.as_deref())
            .bind(key.created_at)
            .bind(key.expires_at);
        self.execute(q).await?;
        Ok(())
    }

    /// The key whose secret hashes to `hash`, unless it expired by `now`.
    pub async fn key_by_hash(&self, hash: &str, now: i64) -> StoreResult<Option<StoredKey>> {
        let sql = format!("SELECT {COLUMNS} FROM api_keys WHERE hash = $1 AND (expires_at IS NULL OR expires_at > $2)");
        Ok(self.fetch_optional::<KeyRow>(Query::new(sql).bind(hash).bind(now)).await?.map(key))
    }

    /// Every key, newest first.
    pub async fn list_keys(&self) -> StoreResult<Vec<StoredKey>> {
        let sql = format!("SELECT {COLUMNS} FROM api_keys ORDER BY created_at DESC, id");
        Ok(self.fetch_all::<KeyRow>(Query::new(sql)).await?.into_iter().map(key).collect())
    }

    /// Revokes a key: its row and its sessions go (false: there was none).
    pub async fn revoke_key(&self, id: &str) -> StoreResult<bool> {
        let removed = self.execute(Query::new("DELETE FROM api_keys WHERE id = $1").bind(id)).await? > 0;
        let credential = format!("key:{id}");
        self.execute(Query::new("DELETE FROM sessions WHERE credential = $1").bind(credential)).await?;
        Ok(removed)
    }

    /// Which of the keys `ids` still work at `now`.
    pub async fn live_keys(&self, ids: &[&str], now: i64) -> StoreResult<Vec<String>> {
        let sql = "SELECT id FROM api_keys WHERE (expires_at IS NULL OR expires_at > $1) AND id IN ({list})";
        self.found_among(sql, now, ids).await
    }

    /// Notes that the key was used at `now`.
    pub async fn key_used(&self, id: &str, now: i64) -> StoreResult<()> {
        self.execute(Query::new("UPDATE api_keys SET last_used_at = $2 WHERE id = $1").bind(id).bind(now)).await?;
        Ok(())
    }
}
