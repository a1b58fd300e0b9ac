//! The schema's migrations, applied at open. The bookkeeping is sqlx's (`_sqlx_migrations`:
//! version, description, SHA-384 checksum of the SQL), which earlier builds used: databases
//! they made open here, and a migration edited after it was applied is refused.

use std::time::Instant;

use ring::digest::{SHA384, digest};
use rusqlite::Connection;

use super::{StoreError, StoreResult};

const TABLE: &str = "CREATE TABLE IF NOT EXISTS _sqlx_migrations (
    version BIGINT PRIMARY KEY,
    description TEXT NOT NULL,
    installed_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
    success BOOLEAN NOT NULL,
    checksum BLOB NOT NULL,
    execution_time BIGINT NOT NULL
)";

/// Applies the migrations not applied yet, each in a transaction of its own, after checking
/// the applied ones against `migrations` (version, description, SQL; oldest first).
pub(super) fn migrate(c: &mut Connection, migrations: &[(i64, &str, &str)]) -> StoreResult<()> {
    let refuse = |why: String| StoreError::Migrate(why);
    c.execute_batch(TABLE)?;
    let dirty: Option<i64> = c
        .prepare("SELECT version FROM _sqlx_migrations WHERE success = false ORDER BY version LIMIT 1")?
        .query_map((), |row| row.get(0))?
        .next()
        .transpose()?;
    if let Some(version) = dirty {
        return Err(refuse(format!("migration {version} was left partly applied; repair the database by hand")));
    }
    let applied: Vec<(i64, Vec<u8>)> = c
        .prepare("SELECT version, checksum FROM _sqlx_migrations ORDER BY version")?
        .query_map((), |row| Ok((row.get(0)?, row.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?;
    for (version, checksum) in &applied {
        match migrations.iter().find(|(v, _, _)| v == version) {
            None => {
                return Err(refuse(format!(
                    "the database has migration {version}, which this build does not know (a newer build made it)"
                )));
            }
            Some((_, _, sql)) if digest(&SHA384, sql.as_bytes()).as_ref() != &checksum[..] => {
                return Err(refuse(format!("migration {version} was applied with different SQL than this build's")));
            }
            Some(_) => {}
        }
    }
    for &(version, description, sql) in migrations {
        if applied.iter().any(|(v, _)| *v == version) {
            continue;
        }
        let started = Instant::now();
        let tx = c.transaction()?;
        tx.execute_batch(sql).map_err(|e| refuse(format!("migration {version} failed: {e}")))?;
        tx.execute(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (?1, ?2, TRUE, ?3, -1)",
            (version, description, digest(&SHA384, sql.as_bytes()).as_ref()),
        )?;
        tx.commit()?;
        let nanos = started.elapsed().as_nanos().min(i64::MAX as u128) as i64;
        c.execute("UPDATE _sqlx_migrations SET execution_time = ?1 WHERE version = ?2", (nanos, version))?;
    }
    Ok(())
}
