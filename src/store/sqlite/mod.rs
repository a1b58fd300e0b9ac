//! The SQLite backend: one file, in WAL mode.
//!
//! All writes go through one connection on a thread of its own (`writer`), so transactions
//! never contend with each other inside the process and `seq` is assigned in the same
//! transaction that inserts the rows. Reads use separate read-only connections (`readers`)
//! and, thanks to WAL, never wait for the writer. Both are rusqlite's; the build needs no
//! other SQLite driver.

pub(super) mod backup;
mod log;
mod migrate;
mod readers;
mod script;
mod turns;
mod writer;

use std::path::Path;
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

use super::batch::{Write, Writes, Written};
use super::{StoreError, StoreOptions, StoreResult};

/// The schema's migrations (`migrations/sqlite`), compiled in, oldest first: version,
/// description (the file name's, with spaces for underscores) and SQL.
pub(super) const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "initial", include_str!("../../../migrations/sqlite/0001_initial.sql")),
    (2, "idempotency", include_str!("../../../migrations/sqlite/0002_idempotency.sql")),
    (3, "chunk checks", include_str!("../../../migrations/sqlite/0003_chunk_checks.sql")),
    (4, "sealed seq", include_str!("../../../migrations/sqlite/0004_sealed_seq.sql")),
    (5, "conversation settings", include_str!("../../../migrations/sqlite/0005_conversation_settings.sql")),
    (6, "turn first seq", include_str!("../../../migrations/sqlite/0006_turn_first_seq.sql")),
    (7, "turn leases", include_str!("../../../migrations/sqlite/0007_turn_leases.sql")),
    (8, "token calibration", include_str!("../../../migrations/sqlite/0008_token_calibration.sql")),
    (9, "deletion", include_str!("../../../migrations/sqlite/0009_deletion.sql")),
    (10, "calibrated model", include_str!("../../../migrations/sqlite/0010_calibrated_model.sql")),
    (11, "identities", include_str!("../../../migrations/sqlite/0011_identities.sql")),
    (12, "bus secret", include_str!("../../../migrations/sqlite/0012_bus_secret.sql")),
    (13, "turn ttft", include_str!("../../../migrations/sqlite/0013_turn_ttft.sql")),
    (14, "credentials", include_str!("../../../migrations/sqlite/0014_credentials.sql")),
];

/// The database's clock in epoch ms, for lease times (see `store/lease.rs`).
pub(super) const NOW_MS: &str = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)";

/// WAL pages past which the writer checkpoints inside its own commit (about 40 MiB).
const WRITER_CHECKPOINT_PAGES: u32 = 10_000;

/// How often the background checkpointer looks for new commits.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);

/// Statements kept prepared on the writer connection (appends of different sizes are
/// different statements).
const WRITER_STATEMENTS: usize = 64;

/// Copies committed WAL frames into the database file after every period with commits, without
/// blocking the writer or readers (a passive checkpoint), on a thread and connection of its
/// own. Any commit counts (`data_version` moves with every other connection's), a rename or a
/// deletion's batch as much as a turn's: a WAL left to the writer's own threshold is copied in
/// one commit, which every write queued behind it waits for. Ends when `stop` is dropped.
fn checkpoints(connection: Connection, stop: mpsc::Receiver<()>) {
    let version = || connection.query_row("PRAGMA data_version", [], |row| row.get::<_, i64>(0)).ok();
    let mut seen = version();
    while let Err(mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(CHECKPOINT_EVERY) {
        let now = version();
        if now.is_some() && now == seen {
            continue;
        }
        seen = now;
        if let Err(e) = connection.execute_batch("PRAGMA wal_checkpoint(PASSIVE)") {
            tracing::debug!(error = %e, "a background checkpoint failed; the next one retries");
        }
    }
}

/// The background checkpointer's thread, stopped by `close`.
struct Checkpointer {
    stop: Mutex<Option<(mpsc::Sender<()>, JoinHandle<()>)>>,
}

#[derive(Clone)]
pub(crate) struct Sqlite {
    /// The one connection that writes.
    pub(super) writer: Arc<writer::Writer>,
    /// Read-only connections, for every read.
    pub(super) readers: readers::Readers,
    checkpointer: Arc<Checkpointer>,
}

/// Opens a read-write connection to the file (created when missing) in WAL mode.
fn connect(path: &Path, limits: &StoreOptions) -> StoreResult<Connection> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let c = Connection::open_with_flags(path, flags)?;
    c.busy_timeout(limits.busy_timeout)?;
    c.pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get::<_, String>(0))?;
    c.pragma_update(None, "synchronous", "NORMAL")?;
    c.pragma_update(None, "foreign_keys", "ON")?;
    Ok(c)
}

impl Sqlite {
    /// Opens (creating when missing) the database file and applies the migrations.
    pub(crate) async fn open(path: &Path, limits: StoreOptions) -> StoreResult<Sqlite> {
        let path = path.to_owned();
        match tokio::task::spawn_blocking(move || Self::open_here(&path, limits)).await {
            Ok(opened) => opened,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(StoreError::Cancelled),
        }
    }

    fn open_here(path: &Path, limits: StoreOptions) -> StoreResult<Sqlite> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(|source| StoreError::Folder { path: parent.display().to_string(), source })?;
        }
        // Checkpoints (copying the WAL into the database file, with an fsync) run on a
        // connection of their own (see `checkpoints`), off the writer's path: a checkpoint
        // inside a commit stalls every write queued behind it. The writer checkpoints itself
        // only past WRITER_CHECKPOINT_PAGES, so the WAL is restarted even when writes never
        // pause (by then the background checkpoints have copied nearly all of it).
        let mut writer = connect(path, &limits)?;
        writer.pragma_update(None, "wal_autocheckpoint", WRITER_CHECKPOINT_PAGES)?;
        if limits.max_pages > 0 {
            writer.pragma_update_and_check(
                None,
                "max_page_count",
                limits.max_pages.min(i64::MAX as u64) as i64,
                |row| row.get::<_, i64>(0),
            )?;
        }
        writer.set_prepared_statement_cache_capacity(WRITER_STATEMENTS);
        migrate::migrate(&mut writer, MIGRATIONS)?;
        let checkpointer = connect(path, &limits)?;
        let (stop, stopped) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("sqlite-checkpoints".into())
            .spawn(move || checkpoints(checkpointer, stopped))
            .map_err(|e| StoreError::Unwritable(format!("could not start the checkpointer: {e}")))?;
        Ok(Sqlite {
            writer: Arc::new(writer::Writer::start(writer)?),
            readers: readers::Readers::new(path, limits.busy_timeout),
            checkpointer: Arc::new(Checkpointer { stop: Mutex::new(Some((stop, thread))) }),
        })
    }

    /// Describes an error that means "writes are refused now", or None for other errors.
    pub(crate) fn unwritable(&self, e: &StoreError) -> Option<String> {
        let StoreError::Sqlite(rusqlite::Error::SqliteFailure(failure, _)) = e else {
            return None;
        };
        Some(
            match failure.extended_code & 0xff {
                13 => "the database is full",
                5 | 6 => "the database is locked by another writer",
                8 => "the database is read-only",
                10 => "the database file cannot be written (I/O error)",
                _ => return None,
            }
            .to_owned(),
        )
    }

    /// A write that changes nothing once done, through the writer: a row of the migrations'
    /// table taken and given back in one transaction, large enough to need pages of its own
    /// (a full database refuses it) and committed (a locked or read-only one refuses that).
    pub(crate) async fn probe_write(&self) -> StoreResult<()> {
        self.writer
            .run(|c| {
                let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                tx.execute(
                    "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
                     VALUES (-1, 'write probe', 0, zeroblob(16384), 0)",
                    (),
                )?;
                tx.execute("DELETE FROM _sqlx_migrations WHERE version = -1", ())?;
                tx.commit()?;
                Ok(())
            })
            .await
    }

    pub(crate) async fn ping(&self) -> bool {
        self.readers.run(|c| c.query_row("SELECT 1", (), |_| Ok(()))).await.is_ok()
    }

    /// Closes the connections, letting writes in flight finish; the WAL is checkpointed when
    /// the last one closes.
    pub(crate) async fn close(&self) {
        self.readers.close();
        let checkpointer = self.checkpointer.stop.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some((stop, thread)) = checkpointer {
            drop(stop);
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        self.writer.close().await;
    }
}

/// Runs the writes in one transaction on the writer connection; an error means nothing was
/// committed.
fn transaction(c: &mut Connection, writes: &[Arc<Write>]) -> StoreResult<Vec<Written>> {
    if !c.is_autocommit() {
        // A failed COMMIT (the database busy, say) leaves its transaction open.
        c.execute_batch("ROLLBACK")?;
    }
    c.execute_batch("BEGIN IMMEDIATE")?;
    let done = writes.iter().map(|w| turns::apply(c, w)).collect::<StoreResult<Vec<_>>>().and_then(|answers| {
        c.execute_batch("COMMIT")?;
        Ok(answers)
    });
    // SQLite rolls some failures back on its own (a full disk, an I/O error); others leave
    // the transaction open.
    if done.is_err() && !c.is_autocommit() {
        let _ = c.execute_batch("ROLLBACK");
    }
    done
}

impl Writes for Sqlite {
    async fn commit(&self, writes: Vec<Arc<Write>>) -> StoreResult<Vec<Written>> {
        self.writer.run(move |c| transaction(c, &writes)).await
    }
}
