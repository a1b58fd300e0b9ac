//! The database: conversations, the chunk log and per-turn rows, on one of two backends.
//!
//! SQLite (`sqlite/`) is the default: one file, nothing to run. PostgreSQL (`postgres/`) is for
//! several gateways sharing the work. `Store` is what the rest of the gateway sees (an enum
//! inside, so every call is a direct one). Statements both databases take alike are written
//! once, in this folder's files, as `sql::Query` values either backend runs (SQLite on
//! rusqlite, PostgreSQL on sqlx, built only with the `cluster` feature); each backend has only
//! what must differ: opening, the writes of turns (the group-commit writer task, `batch`,
//! drives them), history windows, crash recovery. Both keep the log's contract the same way: `seq`
//! and message ids are assigned from the conversation row's counters inside the transaction
//! that inserts the chunks. docs/storage.md compares the two.

mod batch;
mod bus_secret;
mod conversations;
mod deletion;
mod keys;
mod lease;
mod log;
#[cfg(feature = "cluster")]
mod postgres;
mod quotas;
mod reads;
mod series;
mod sessions;
mod sql;
mod sqlite;
mod turns;
mod writes;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::Database;
use crate::metrics::Metrics;
pub use conversations::{ConversationFilter, NewConversation, Ownership, Setting, Settings};
pub use keys::StoredKey;
pub use log::{HistoryPage, HistoryWindow};
pub use quotas::{OverBudget, TurnBudget};
pub use reads::{History, HistoryChunk, LastText, ModelThroughput, RuntimeMemory};
pub use series::{FailedTurn, SlotRow, TTFT_BOUNDS_MS};
pub use sessions::StoredSession;
pub use sqlite::backup::BackupError;
pub use turns::{INTERRUPTED_MESSAGE, user_chunk};
pub use writes::{BeginTurn, Charge, IdempotencyRecord, NewChunk, SealTurn};

/// `--backup`: a consistent copy of the SQLite database in the new file `to`, taken while a
/// gateway may be running on it; the copy's size in bytes.
pub fn backup(database: &Database, to: &std::path::Path, busy_timeout: Duration) -> Result<u64, BackupError> {
    match database {
        Database::Sqlite(path) => sqlite::backup::backup(path, to, busy_timeout),
        Database::Postgres(_) => Err(BackupError::NotSqlite),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[cfg(feature = "cluster")]
    #[error("database error: {0}")]
    Postgres(#[from] sqlx::Error),
    #[error("migration failed: {0}")]
    Migrate(String),
    #[error("could not prepare the database folder {path}: {source}")]
    Folder { path: String, source: std::io::Error },
    #[error("a conversation with this id already exists")]
    Exists,
    /// The database refuses writes (full, locked by another writer, read-only, I/O error,
    /// unreachable).
    #[error("{0}")]
    Unwritable(String),
    #[error("this idempotency key was already used")]
    DuplicateKey,
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    /// Another turn holds the conversation's lease (on this gateway or another).
    #[error("a turn is already generating for this conversation")]
    Busy,
    /// The subject's new turn would pass one of its quotas (checked in the opening write's
    /// transaction: nothing was written).
    #[error("the turn would pass the quota {}", .0.limit)]
    OverBudget(OverBudget),
    /// The conversation is being deleted (its id is free once it is gone).
    #[error("the conversation is being deleted")]
    Deleting,
    /// A read in pages found its conversation deleted (or deleted and created again) part way.
    #[error("the conversation was deleted while it was read")]
    DeletedDuringRead,
    /// A turn's write was refused: the turn no longer holds its conversation's lease (it
    /// expired and another gateway marked the turn interrupted, or the conversation is gone).
    #[error("the turn no longer holds its conversation (its lease ended)")]
    LeaseLost,
    /// A read on the blocking pool was dropped (the runtime is shutting down).
    #[error("the read was cancelled")]
    Cancelled,
    /// A PostgreSQL database in a build without the `cluster` feature.
    #[error("PostgreSQL needs the `cluster` build: `cargo build --release --features cluster`")]
    NotBuilt,
}

pub type StoreResult<T> = Result<T, StoreError>;

/// Limits of the database connections.
#[derive(Debug, Clone, Copy)]
pub struct StoreOptions {
    /// SQLite: how long a write waits for another writer's lock.
    pub busy_timeout: Duration,
    /// SQLite: largest database size in pages (0: no limit beyond SQLite's own).
    pub max_pages: u64,
    /// PostgreSQL: most connections open at once.
    pub max_connections: u32,
    /// How long a turn's lease on its conversation lasts unless renewed (see `lease`).
    pub lease_ttl: Duration,
    /// Most rows one write of a conversation's deletion removes (see `deletion`).
    pub delete_batch_rows: u64,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            busy_timeout: Duration::from_secs(5),
            max_pages: 0,
            max_connections: 16,
            lease_ttl: Duration::from_secs(10),
            delete_batch_rows: 1000,
        }
    }
}

#[derive(Clone)]
enum Backend {
    Sqlite(sqlite::Sqlite),
    #[cfg(feature = "cluster")]
    Postgres(postgres::Postgres),
}

/// Runs `$body` with `$b` bound to the store's backend, whichever it is.
macro_rules! on_backend {
    ($store:expr, $b:ident => $body:expr) => {
        match &$store.backend {
            $crate::store::Backend::Sqlite($b) => $body,
            #[cfg(feature = "cluster")]
            $crate::store::Backend::Postgres($b) => $body,
        }
    };
}
use on_backend;

/// The least time between two probes of a database whose writes failed.
const PROBE_EVERY: Duration = Duration::from_secs(1);

#[derive(Clone)]
pub struct Store {
    backend: Backend,
    lease_ttl: Duration,
    delete_batch_rows: u64,
    metrics: Arc<Metrics>,
    /// Why the last write failed, while writes fail (for `/ready`).
    write_fault: Arc<Mutex<Option<String>>>,
    /// When the database was last probed for a write fault (see `current_write_fault`).
    probed: Arc<Mutex<Option<std::time::Instant>>>,
    /// The writer task's queue (group commit, see `batch`); `None` in the task's own copy, so
    /// the task ends when the last handle to the store is dropped.
    queue: Option<tokio::sync::mpsc::UnboundedSender<batch::Queued>>,
}

impl Store {
    /// Opens the database (creating a SQLite file when missing), applies the migrations, and
    /// marks turns a dead process left open interrupted before anything is served (see
    /// `Store::recover_interrupted`).
    pub async fn open(database: &Database, metrics: Arc<Metrics>) -> StoreResult<Store> {
        Self::open_with(database, metrics, StoreOptions::default()).await
    }

    pub async fn open_with(database: &Database, metrics: Arc<Metrics>, limits: StoreOptions) -> StoreResult<Store> {
        let backend = match database {
            Database::Sqlite(path) => Backend::Sqlite(sqlite::Sqlite::open(path, limits).await?),
            #[cfg(feature = "cluster")]
            Database::Postgres(url) => Backend::Postgres(postgres::Postgres::open(url, limits).await?),
            #[cfg(not(feature = "cluster"))]
            Database::Postgres(_) => return Err(StoreError::NotBuilt),
        };
        let mut store = Store {
            backend,
            lease_ttl: limits.lease_ttl,
            delete_batch_rows: limits.delete_batch_rows.max(1),
            metrics,
            write_fault: Arc::default(),
            probed: Arc::default(),
            queue: None,
        };
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
            Err(e) => match on_backend!(self, b => b.unwritable(&e)) {
                Some(why) => {
                    tracing::error!(error = %e, "{why}");
                    *fault = Some(why.clone());
                    Err(StoreError::Unwritable(why))
                }
                None => Err(e),
            },
        }
    }

    /// Why writes fail, while they do.
    pub fn write_fault(&self) -> Option<String> {
        self.write_fault.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Why writes fail now: while a fault is set, the database is probed with a write that
    /// changes nothing, at most once per `PROBE_EVERY` (readiness checks come as often as a
    /// load balancer likes), and a probe that passes clears the fault. Without it, a fault
    /// stayed until some other write succeeded, which behind a load balancer that stopped
    /// sending turns never came.
    pub async fn current_write_fault(&self) -> Option<String> {
        let fault = self.write_fault()?;
        {
            let mut last = self.probed.lock().unwrap_or_else(|p| p.into_inner());
            if last.is_some_and(|at| at.elapsed() < PROBE_EVERY) {
                return Some(fault);
            }
            *last = Some(std::time::Instant::now());
        }
        let probed = on_backend!(self, b => b.probe_write().await);
        match self.noted(probed) {
            Ok(()) => None,
            Err(_) => Some(self.write_fault().unwrap_or(fault)),
        }
    }

    /// Answers whether the database serves a trivial query.
    pub async fn ping(&self) -> bool {
        on_backend!(self, b => b.ping().await)
    }

    /// Closes the connections, waiting for queries in flight.
    pub async fn close(&self) {
        on_backend!(self, b => b.close().await)
    }
}

#[cfg(test)]
impl Store {
    /// The SQLite backend, for tests of SQLite's own machinery.
    pub(crate) fn sqlite(&self) -> &sqlite::Sqlite {
        match &self.backend {
            Backend::Sqlite(s) => s,
            #[cfg(feature = "cluster")]
            Backend::Postgres(_) => panic!("not a SQLite store"),
        }
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

/// Stores for the tests that hold for every backend: SQLite in a temporary folder, and
/// PostgreSQL in a fresh database when `DISPATCH_TEST_POSTGRES` names a server.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// A store with what keeps its database alive; the name says which backend it is.
    pub(crate) struct TestStore {
        pub store: Store,
        pub metrics: Arc<Metrics>,
        pub backend: &'static str,
        _dir: Option<tempfile::TempDir>,
        _database: Option<dispatch_testkit::postgres::FreshDatabase>,
    }

    /// What `read` returns once it returns something: polled every 50 ms for up to 5 s (a
    /// lease ends on the database's clock).
    pub(crate) async fn once_some<T, F, Fut>(mut read: F) -> Vec<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = StoreResult<Vec<T>>>,
    {
        let mut got = Vec::new();
        for _ in 0..100 {
            got = read().await.unwrap();
            if !got.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        got
    }

    pub(crate) async fn every_backend() -> Vec<TestStore> {
        every_backend_with(StoreOptions::default()).await
    }

    pub(crate) async fn every_backend_with(options: StoreOptions) -> Vec<TestStore> {
        let mut stores = Vec::new();
        let dir = tempfile::tempdir().unwrap();
        let metrics = Arc::new(Metrics::default());
        let sqlite = Database::Sqlite(dir.path().join("test.db"));
        let store = Store::open_with(&sqlite, metrics.clone(), options).await.unwrap();
        stores.push(TestStore { store, metrics, backend: "sqlite", _dir: Some(dir), _database: None });
        #[cfg(feature = "cluster")]
        if let Some(database) = dispatch_testkit::postgres::fresh_database().await {
            let metrics = Arc::new(Metrics::default());
            let postgres = Database::Postgres(database.url.clone());
            let store = Store::open_with(&postgres, metrics.clone(), options).await.unwrap();
            stores.push(TestStore { store, metrics, backend: "postgres", _dir: None, _database: Some(database) });
        }
        stores
    }

    /// Each backend's compiled-in list is its migrations folder, named as sqlx names a
    /// folder's files (`0003_chunk_checks.sql`: version 3, "chunk checks"), so databases
    /// made by earlier builds, whose migrations sqlx read from the folder, match them.
    #[test]
    fn the_compiled_in_migrations_are_the_folders() {
        let folders = [
            ("sqlite", sqlite::MIGRATIONS),
            #[cfg(feature = "cluster")]
            ("postgres", postgres::MIGRATIONS),
        ];
        for (folder, listed) in folders {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations").join(folder);
            let mut from_folder: Vec<(i64, String, String)> = std::fs::read_dir(&path)
                .unwrap()
                .map(|entry| {
                    let path = entry.unwrap().path();
                    let name = path.file_stem().unwrap().to_str().unwrap().to_owned();
                    let (version, description) = name.split_once('_').unwrap();
                    let sql = std::fs::read_to_string(&path).unwrap();
                    (version.parse().unwrap(), description.replace('_', " "), sql)
                })
                .collect();
            from_folder.sort();
            let listed: Vec<(i64, String, String)> =
                listed.iter().map(|&(v, d, sql)| (v, d.to_owned(), sql.to_owned())).collect();
            assert_eq!(listed, from_folder, "{folder}");
        }
    }

    /// A database an earlier build made (sqlx's SQLite driver and migrator, two sealed turns,
    /// an idempotency key, a title) opens, its history and metrics read as written, and new
    /// turns continue its log.
    #[tokio::test]
    async fn a_database_made_by_an_earlier_build_opens_and_continues() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("upgrade.db");
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sqlx-made.sqlite");
        std::fs::copy(fixture, &path).unwrap();
        let store = Store::open(&Database::Sqlite(path.clone()), Arc::default()).await.unwrap();
        let meta = store.conversation("old-chat").await.unwrap().unwrap();
        assert_eq!(meta.title, "Kept across the upgrade");
        let all = HistoryWindow { since_seq: 0, before_seq: None, limit: None, inflight: false };
        assert_eq!(store.history("old-chat", all).await.unwrap().last_seq, Some(6));
        assert_eq!(store.turn_metrics("old-chat").await.unwrap().len(), 2);
        let (hash, _) = store.idempotent_response("old-chat", "k1").await.unwrap().unwrap();
        assert!(!hash.is_empty());
        store.begin_test_turn("old-chat", "new-turn").await;
        assert_eq!(store.append_chunks("old-chat", "new-turn", &[]).await.unwrap(), 7);
        store.close().await;
        // Reopened: the migrations are not applied twice, the new turn is there (interrupted).
        let store = Store::open(&Database::Sqlite(path), Arc::default()).await.unwrap();
        let all = HistoryWindow { since_seq: 0, before_seq: None, limit: None, inflight: false };
        assert_eq!(store.history("old-chat", all).await.unwrap().last_seq, Some(8));
        store.close().await;
    }

    /// A file that is not a SQLite database is refused at open with SQLite's reason, and left
    /// as it was.
    #[tokio::test]
    async fn a_file_that_is_not_a_database_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notes.db");
        let text = "these are notes, not a database\n".repeat(200);
        std::fs::write(&path, &text).unwrap();
        let err = Store::open(&Database::Sqlite(path.clone()), Arc::default()).await.err().expect("refused");
        assert!(err.to_string().contains("not a database"), "{err}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
    }

    /// A migration edited after a database applied it is refused, not silently skipped.
    #[tokio::test]
    async fn a_database_whose_migration_differs_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("edited.db");
        Store::open(&Database::Sqlite(path.clone()), Arc::default()).await.unwrap().close().await;
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute("UPDATE _sqlx_migrations SET checksum = x'00' WHERE version = 3", ()).unwrap();
        drop(c);
        let err = Store::open(&Database::Sqlite(path), Arc::default()).await.err().expect("refused");
        assert!(matches!(&err, StoreError::Migrate(why) if why.contains("migration 3")), "{err}");
    }

    /// A caller that opens the store without `Config::check` (the tests, an embedder) is
    /// refused too, before anything connects.
    #[cfg(not(feature = "cluster"))]
    #[tokio::test]
    async fn a_build_without_the_cluster_feature_refuses_to_open_postgres() {
        let postgres = Database::Postgres("postgres://u@127.0.0.1:1/db".into());
        let err = Store::open(&postgres, Arc::default()).await.err().expect("refused");
        assert!(matches!(err, StoreError::NotBuilt), "{err}");
        assert!(err.to_string().contains("--features cluster"), "{err}");
    }

    #[test]
    fn database_values_name_a_file_or_a_postgres_url() {
        let parse = |s: &str| s.parse::<Database>();
        assert_eq!(parse("./data/x.db"), Ok(Database::Sqlite("./data/x.db".into())));
        assert_eq!(parse("sqlite:///tmp/x.db"), Ok(Database::Sqlite("/tmp/x.db".into())));
        assert_eq!(parse("sqlite:x.db"), Ok(Database::Sqlite("x.db".into())));
        assert_eq!(parse("postgres://u:p@h/db"), Ok(Database::Postgres("postgres://u:p@h/db".into())));
        assert!(parse("postgresql://h/db").is_ok());
        assert!(parse("").unwrap_err().contains("empty"));
        assert!(parse("mysql://h/db").unwrap_err().contains("\"mysql\""));
        assert_eq!(parse("postgres://u:secret@h:5432/db").unwrap().to_string(), "postgres://u:***@h:5432/db");
        assert_eq!(parse("postgres://u@h/db").unwrap().to_string(), "postgres://u@h/db");
    }
}
