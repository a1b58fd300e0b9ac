//! The database: conversations, the chunk log and per-turn rows, in SQLite through sqlx.
//!
//! All writes go through one connection (`writer`), so transactions never contend with each
//! other inside the process and `seq` is assigned in the same transaction that inserts the rows.
//! Reads use separate read-only connections (sqlx's pool, and `readers` for history windows)
//! and, thanks to WAL, never wait for the writer.

mod batch;
mod conversations;
mod log;
mod readers;
mod reads;
mod script;
mod turns;

use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite, SqlitePool, Transaction};

use crate::metrics::Metrics;
pub use conversations::{ConversationFilter, NewConversation, Setting, Settings};
pub use log::{HistoryPage, HistoryWindow, NewChunk};
pub use reads::{HistoryChunk, LastText, ModelThroughput};
pub use turns::{BeginTurn, IdempotencyRecord, SealTurn, user_chunk};

/// The schema's migrations, compiled in, oldest first: version, description (the file name's,
/// as sqlx spells it) and SQL. Listed by hand rather than by sqlx's `migrate!`, whose proc
/// macro builds a second SQLite for the build host (a first build's slowest minute); a test
/// checks the list against the folder.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "initial", include_str!("../../migrations/0001_initial.sql")),
    (2, "idempotency", include_str!("../../migrations/0002_idempotency.sql")),
    (3, "chunk checks", include_str!("../../migrations/0003_chunk_checks.sql")),
    (4, "sealed seq", include_str!("../../migrations/0004_sealed_seq.sql")),
    (5, "conversation settings", include_str!("../../migrations/0005_conversation_settings.sql")),
    (6, "turn first seq", include_str!("../../migrations/0006_turn_first_seq.sql")),
];

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

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("database error: {0}")]
    Read(#[from] rusqlite::Error),
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("could not prepare the database folder {path}: {source}")]
    Folder { path: String, source: std::io::Error },
    #[error("a conversation with this id already exists")]
    Exists,
    /// The database refuses writes (full, locked by another writer, read-only, I/O error).
    #[error("{0}")]
    Unwritable(String),
    #[error("this idempotency key was already used")]
    DuplicateKey,
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    /// A read on the blocking pool was dropped (the runtime is shutting down).
    #[error("the read was cancelled")]
    Cancelled,
}

pub type StoreResult<T> = Result<T, StoreError>;

#[derive(Clone)]
pub struct Store {
    writer: SqlitePool,
    reader: SqlitePool,
    /// Read-only connections for the hot reads (history windows), run without a thread hop.
    readers: readers::Readers,
    /// The connection background checkpoints run on.
    checkpointer: SqlitePool,
    metrics: Arc<Metrics>,
    /// Why the last write failed, while writes fail (for `/ready`).
    write_fault: Arc<Mutex<Option<String>>>,
    /// The writer task's queue (group commit, see `batch`); `None` in the task's own copy, so
    /// the task ends when the last handle to the store is dropped.
    queue: Option<tokio::sync::mpsc::UnboundedSender<batch::Queued>>,
}

/// Limits of the SQLite connection.
#[derive(Debug, Clone, Copy)]
pub struct StoreOptions {
    /// How long a write waits for another writer's lock.
    pub busy_timeout: Duration,
    /// Largest database size in pages (0: no limit beyond SQLite's own).
    pub max_pages: u64,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions { busy_timeout: Duration::from_secs(5), max_pages: 0 }
    }
}

/// Describes a database error that means "writes are refused now", or None for other errors.
fn unwritable(e: &sqlx::Error) -> Option<String> {
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

impl Store {
    /// Opens (creating when missing) the database file, applies the migrations, and repairs
    /// turns a previous process left open before anything is served.
    pub async fn open(path: &Path, metrics: Arc<Metrics>) -> StoreResult<Store> {
        Self::open_with(path, metrics, StoreOptions::default()).await
    }

    pub async fn open_with(path: &Path, metrics: Arc<Metrics>, limits: StoreOptions) -> StoreResult<Store> {
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
        migrator().run(&writer).await?;
        let reader = SqlitePoolOptions::new().max_connections(4).connect_with(options.clone().read_only(true)).await?;
        let checkpointer = SqlitePoolOptions::new().max_connections(1).connect_with(options).await?;
        tokio::spawn(checkpoints(checkpointer.clone(), metrics.clone()));
        let readers = readers::Readers::new(path, limits.busy_timeout);
        let mut store =
            Store { writer, reader, readers, checkpointer, metrics, write_fault: Arc::default(), queue: None };
        let (queue, writes) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(store.clone().run_writer(writes));
        store.queue = Some(queue);
        let repaired = store.recover_interrupted(now_ms()).await?;
        if repaired > 0 {
            tracing::warn!(turns = repaired, "marked turns cut off by the last shutdown as interrupted");
        }
        Ok(store)
    }

    /// Records the outcome of a write: a refusal becomes `Unwritable` and is remembered until a
    /// write succeeds again.
    fn noted<T>(&self, result: StoreResult<T>) -> StoreResult<T> {
        let mut fault = self.write_fault.lock().unwrap_or_else(|p| p.into_inner());
        match result {
            Ok(v) => {
                *fault = None;
                Ok(v)
            }
            Err(StoreError::Database(e)) => match unwritable(&e) {
                Some(why) => {
                    tracing::error!(error = %e, "{why}");
                    *fault = Some(why.clone());
                    Err(StoreError::Unwritable(why))
                }
                None => Err(StoreError::Database(e)),
            },
            Err(e) => Err(e),
        }
    }

    /// Why writes fail, while they do.
    pub fn write_fault(&self) -> Option<String> {
        self.write_fault.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Answers whether the database serves a trivial query.
    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.reader).await.is_ok()
    }

    /// Closes the pools, waiting for queries in flight; the WAL is checkpointed on close.
    pub async fn close(&self) {
        self.readers.close();
        self.checkpointer.close().await;
        self.reader.close().await;
        self.writer.close().await;
    }

    /// Opens a write transaction; hand it back to [`Store::commit`] with the start instant.
    async fn write_tx(&self) -> StoreResult<(Transaction<'static, Sqlite>, Instant)> {
        let started = Instant::now();
        match self.writer.begin_with("BEGIN IMMEDIATE").await {
            Err(sqlx::Error::InvalidSavePointStatement) => {
                // A failed write (database full, I/O error) made SQLite roll the transaction
                // back on its own; the connection still believes it is inside one and refuses
                // to begin. Replace it with a fresh connection.
                tracing::warn!("replacing the database writer connection after a failed transaction");
                let stale = self.writer.acquire().await?;
                drop(stale.detach());
                Ok((self.writer.begin_with("BEGIN IMMEDIATE").await?, started))
            }
            other => Ok((other?, started)),
        }
    }

    /// Commits and records how long the transaction took, from its start.
    async fn commit(&self, tx: Transaction<'static, Sqlite>, started: Instant) -> StoreResult<()> {
        tx.commit().await?;
        self.metrics.observe_write(started.elapsed());
        Ok(())
    }
}

/// Wall-clock now in epoch milliseconds (for stored times only; durations use `Instant`).
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// A conversation's status as the database spells it (its CHECK allows only these three).
fn status_of(name: &str) -> StoreResult<crate::wire::ConversationStatus> {
    crate::wire::ConversationStatus::parse(name)
        .ok_or_else(|| StoreError::Corrupt(format!("a conversation has the status {name:?}")))
}

#[cfg(test)]
mod tests {
    /// The compiled-in list is the migrations folder, as sqlx reads a folder: the same
    /// versions, descriptions and checksums (so databases made by earlier builds, whose
    /// migrations came from the folder, open without a checksum mismatch).
    #[tokio::test]
    async fn the_compiled_in_migrations_are_the_folder() {
        let folder =
            sqlx::migrate::Migrator::new(std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations")))
                .await
                .unwrap();
        let listed = super::migrator();
        let key = |m: &sqlx::migrate::Migration| (m.version, m.description.to_string(), m.checksum.to_vec());
        assert_eq!(listed.iter().map(key).collect::<Vec<_>>(), folder.iter().map(key).collect::<Vec<_>>());
    }
}
