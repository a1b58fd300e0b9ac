//! The SQLite backend: one file, in WAL mode.
//!
//! All writes go through one connection (`writer`), so transactions never contend with each
//! other inside the process and `seq` is assigned in the same transaction that inserts the rows.
//! Reads use separate read-only connections (sqlx's pool, and `readers` for history windows)
//! and, thanks to WAL, never wait for the writer.

mod log;
mod readers;
mod script;
mod turns;

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite as Driver, SqlitePool, Transaction};

use super::batch::{Write, Writes, Written};
use super::{StoreError, StoreOptions, StoreResult};
use crate::metrics::Metrics;

/// The schema's migrations (`migrations/sqlite`), compiled in, oldest first: version,
/// description (the file name's, as sqlx spells it) and SQL.
pub(super) const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "initial", include_str!("../../../migrations/sqlite/0001_initial.sql")),
    (2, "idempotency", include_str!("../../../migrations/sqlite/0002_idempotency.sql")),
    (3, "chunk checks", include_str!("../../../migrations/sqlite/0003_chunk_checks.sql")),
    (4, "sealed seq", include_str!("../../../migrations/sqlite/0004_sealed_seq.sql")),
    (5, "conversation settings", include_str!("../../../migrations/sqlite/0005_conversation_settings.sql")),
    (6, "turn first seq", include_str!("../../../migrations/sqlite/0006_turn_first_seq.sql")),
    (7, "turn leases", include_str!("../../../migrations/sqlite/0007_turn_leases.sql")),
];

/// The database's clock in epoch ms, for lease times (see `store/lease.rs`).
pub(super) const NOW_MS: &str = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)";

/// WAL pages past which the writer checkpoints inside its own commit (about 40 MiB).
const WRITER_CHECKPOINT_PAGES: u32 = 10_000;

/// How often the background checkpointer looks for new commits.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);

/// Copies committed WAL frames into the database file after every period with commits, without
/// blocking the writer or readers (a passive checkpoint). Ends when the pool is closed.
async fn checkpoints(pool: SqlitePool, metrics: Arc<Metrics>) {
    let mut seen = metrics.writes();
    let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !pool.is_closed() {
        tick.tick().await;
        let writes = metrics.writes();
        if writes == seen {
            continue;
        }
        seen = writes;
        if let Err(e) = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)").execute(&pool).await {
            if pool.is_closed() {
                return;
            }
            tracing::debug!(error = %e, "a background checkpoint failed; the next one retries");
        }
    }
}

#[derive(Clone)]
pub(crate) struct Sqlite {
    pub(super) writer: SqlitePool,
    pub(super) reader: SqlitePool,
    /// Read-only connections for the hot reads (history windows), run without a thread hop.
    readers: readers::Readers,
    /// The connection background checkpoints run on.
    checkpointer: SqlitePool,
}

impl Sqlite {
    /// Opens (creating when missing) the database file and applies the migrations.
    pub(crate) async fn open(path: &Path, metrics: Arc<Metrics>, limits: StoreOptions) -> StoreResult<Sqlite> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(|source| StoreError::Folder { path: parent.display().to_string(), source })?;
        }
        let options = SqliteConnectOptions::from_str("sqlite:")?
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(limits.busy_timeout);
        // Checkpoints (copying the WAL into the database file, with an fsync) run on a
        // connection of their own (see `checkpoints`), off the writer's path: a checkpoint
        // inside a commit stalls every write queued behind it. The writer checkpoints itself
        // only past WRITER_CHECKPOINT_PAGES, so the WAL is restarted even when writes never
        // pause (by then the background checkpoints have copied nearly all of it).
        let mut writer_options = options.clone().pragma("wal_autocheckpoint", WRITER_CHECKPOINT_PAGES.to_string());
        if limits.max_pages > 0 {
            writer_options = writer_options.pragma("max_page_count", limits.max_pages.to_string());
        }
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(writer_options)
            .await?;
        super::migrator(MIGRATIONS).run(&writer).await?;
        let reader = SqlitePoolOptions::new().max_connections(4).connect_with(options.clone().read_only(true)).await?;
        let checkpointer = SqlitePoolOptions::new().max_connections(1).connect_with(options).await?;
        tokio::spawn(checkpoints(checkpointer.clone(), metrics));
        let readers = readers::Readers::new(path, limits.busy_timeout);
        Ok(Sqlite { writer, reader, readers, checkpointer })
    }

    /// Describes a database error that means "writes are refused now", or None for other errors.
    pub(crate) fn unwritable(&self, e: &sqlx::Error) -> Option<String> {
        if matches!(e, sqlx::Error::PoolTimedOut) {
            return Some("the database writer is stuck".into());
        }
        let code: i64 = e.as_database_error()?.code()?.parse().ok()?;
        Some(
            match code & 0xff {
                13 => "the database is full",
                5 | 6 => "the database is locked by another writer",
                8 => "the database is read-only",
                10 => "the database file cannot be written (I/O error)",
                _ => return None,
            }
            .to_owned(),
        )
    }

    pub(crate) async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.reader).await.is_ok()
    }

    /// Closes the pools, waiting for queries in flight; the WAL is checkpointed on close.
    pub(crate) async fn close(&self) {
        self.readers.close();
        self.checkpointer.close().await;
        self.reader.close().await;
        self.writer.close().await;
    }

    /// Opens a write transaction on the writer connection.
    async fn write_tx(&self) -> StoreResult<Transaction<'static, Driver>> {
        match self.writer.begin_with("BEGIN IMMEDIATE").await {
            Err(sqlx::Error::InvalidSavePointStatement) => {
                // A failed write (database full, I/O error) made SQLite roll the transaction
                // back on its own; the connection still believes it is inside one and refuses
                // to begin. Replace it with a fresh connection.
                tracing::warn!("replacing the database writer connection after a failed transaction");
                let stale = self.writer.acquire().await?;
                drop(stale.detach());
                Ok(self.writer.begin_with("BEGIN IMMEDIATE").await?)
            }
            other => Ok(other?),
        }
    }
}

impl Writes for Sqlite {
    type Db = Driver;

    async fn begin(&self) -> StoreResult<Transaction<'static, Driver>> {
        self.write_tx().await
    }

    async fn apply(&self, tx: &mut Transaction<'static, Driver>, write: &Write) -> StoreResult<Written> {
        turns::apply(tx, write).await
    }
}
