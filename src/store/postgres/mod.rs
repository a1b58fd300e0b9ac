//! The PostgreSQL backend: for several gateways on one database.
//!
//! Every statement is its own round trip (the extended protocol takes one statement at a
//! time), so each write of a turn is as few statements as its steps allow, joined with
//! data-modifying CTEs where one depends on another. Reads and writes share one pool; the
//! group-commit writer task holds one of its connections while it writes.

mod log;
mod turns;

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use super::batch::{Write, Writes, Written};
use super::{StoreError, StoreOptions, StoreResult};

/// The schema's migrations (`migrations/postgres`), compiled in, oldest first.
pub(super) const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "initial", include_str!("../../../migrations/postgres/0001_initial.sql")),
    (2, "turn leases", include_str!("../../../migrations/postgres/0002_turn_leases.sql")),
    (3, "token calibration", include_str!("../../../migrations/postgres/0003_token_calibration.sql")),
    (4, "deletion", include_str!("../../../migrations/postgres/0004_deletion.sql")),
    (5, "calibrated model", include_str!("../../../migrations/postgres/0005_calibrated_model.sql")),
    (6, "identities", include_str!("../../../migrations/postgres/0006_identities.sql")),
    (7, "bus secret", include_str!("../../../migrations/postgres/0007_bus_secret.sql")),
    (8, "turn ttft", include_str!("../../../migrations/postgres/0008_turn_ttft.sql")),
    (9, "credentials", include_str!("../../../migrations/postgres/0009_credentials.sql")),
];

/// The database server's clock in epoch ms, for lease times: every gateway compares them on
/// one clock (see `store/lease.rs`).
pub(super) const NOW_MS: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

/// How long a query waits for a free connection before it fails (the database then counts as
/// unwritable, see `unwritable`).
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone)]
pub(crate) struct Postgres {
    pub(super) pool: PgPool,
}

impl Postgres {
    /// Connects and applies the migrations (sqlx holds an advisory lock meanwhile, so gateways
    /// starting together migrate once).
    pub(crate) async fn open(url: &str, limits: StoreOptions) -> StoreResult<Postgres> {
        let connected = PgPoolOptions::new()
            .max_connections(limits.max_connections.max(2))
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect(url);
        let pool = match connected.await {
            Ok(pool) => pool,
            Err(e) => {
                // The pool only says it timed out; a connection of its own says why (refused,
                // no such database, a wrong password), and the URL is named without its secret.
                let why =
                    match tokio::time::timeout(ACQUIRE_TIMEOUT, <sqlx::PgConnection as sqlx::Connection>::connect(url))
                        .await
                    {
                        Ok(Err(direct)) => direct.to_string(),
                        _ => e.to_string(),
                    };
                let url = crate::config::redacted(url, false);
                return Err(StoreError::Unwritable(format!("cannot connect to PostgreSQL at {url}: {why}")));
            }
        };
        migrator().run(&pool).await.map_err(|e| StoreError::Migrate(e.to_string()))?;
        Ok(Postgres { pool })
    }

    /// Describes an error that means "writes are refused now", or None for other errors.
    pub(crate) fn unwritable(&self, e: &StoreError) -> Option<String> {
        let StoreError::Postgres(e) = e else {
            return None;
        };
        match e {
            sqlx::Error::PoolTimedOut => {
                return Some("no database connection is free (or the server is unreachable)".into());
            }
            sqlx::Error::Io(_) | sqlx::Error::PoolClosed => return Some("the database connection failed".into()),
            _ => {}
        }
        let code = e.as_database_error()?.code()?;
        Some(
            match code.as_ref() {
                "25006" => "the database is read-only",
                c if c.starts_with("53") => "the database server is out of resources (disk full, memory, connections)",
                c if c.starts_with("57P") => "the database server is shutting down",
                c if c.starts_with("08") => "the database connection failed",
                _ => return None,
            }
            .to_owned(),
        )
    }

    /// A write that changes nothing once done: a row of the migrations' table taken and given
    /// back in one transaction (a read-only or full database refuses it).
    pub(crate) async fn probe_write(&self) -> StoreResult<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (-1, 'write probe', false, '\\x00', 0)",
        )
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM _sqlx_migrations WHERE version = -1").execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }

    pub(crate) async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }

    pub(crate) async fn close(&self) {
        self.pool.close().await;
    }
}

/// sqlx's migrator for the compiled-in migrations. Listed by hand rather than by sqlx's
/// `migrate!`, whose proc macro builds a second SQLite for the build host; a test checks the
/// list against the folder.
fn migrator() -> sqlx::migrate::Migrator {
    use sqlx::SqlSafeStr;
    use sqlx::migrate::{Migration, MigrationType, Migrator};
    Migrator::with_migrations(
        MIGRATIONS
            .iter()
            .map(|&(version, description, sql)| {
                let sql = sqlx::AssertSqlSafe(sql).into_sql_str();
                Migration::new(version, description.into(), MigrationType::Simple, sql, false)
            })
            .collect(),
    )
}

impl Writes for Postgres {
    async fn commit(&self, writes: Vec<Arc<Write>>) -> StoreResult<Vec<Written>> {
        let mut tx = self.pool.begin().await?;
        let mut answers = Vec::with_capacity(writes.len());
        for write in &writes {
            match turns::apply(&mut tx, write).await {
                Ok(written) => answers.push(written),
                Err(e) => {
                    let _ = tx.rollback().await;
                    return Err(e);
                }
            }
        }
        tx.commit().await?;
        Ok(answers)
    }
}
