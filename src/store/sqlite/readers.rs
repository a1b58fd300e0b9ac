//! Reads on SQLite connections of their own, run on the calling thread.
//!
//! A short read handed to another thread (a message there, its rows back, a task woken) costs
//! about as much as the query itself. These connections are opened read-only on the same file
//! (WAL: readers never wait for the writer and see only committed transactions), and a
//! bounded read runs where it is awaited, like any other short piece of CPU work, unless it
//! would have to wait for a lock; a read without a bound goes to tokio's blocking pool.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

use super::{StoreError, StoreResult};

/// Connections kept open between reads (more are opened while more reads run at once, and
/// closed after).
pub(super) const IDLE_CONNECTIONS: usize = 4;

/// Statements kept prepared per connection.
const CACHED_STATEMENTS: usize = 32;

/// Read-only connections to the database file.
#[derive(Clone)]
pub struct Readers {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    busy_timeout: Duration,
    /// Idle connections; `None` once closed (connections in use are closed when given back).
    idle: Mutex<Option<Vec<Connection>>>,
}

impl Readers {
    pub fn new(path: &Path, busy_timeout: Duration) -> Readers {
        Readers { inner: Arc::new(Inner { path: path.to_owned(), busy_timeout, idle: Mutex::new(Some(Vec::new())) }) }
    }

    /// Runs `read` where it is awaited when it can start at once, else on the blocking pool:
    /// for reads whose work is bounded and small. The first attempt does not wait for a lock
    /// (a reader in WAL mode meets one only while another process holds the database
    /// exclusively, or recovers its WAL): SQLite's busy handler sleeps, and a sleeping runtime
    /// thread would stall every task on it. Such a read is tried again on the blocking pool,
    /// which waits up to the busy timeout.
    pub async fn run<T: Send + 'static>(
        &self,
        read: impl Fn(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> StoreResult<T> {
        match self.run_here(Duration::ZERO, &read) {
            Err(StoreError::Sqlite(e)) if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy) => {
                self.run_blocking(read).await
            }
            done => done,
        }
    }

    /// Runs `read` on tokio's blocking pool: for reads of any size.
    pub async fn run_blocking<T: Send + 'static>(
        &self,
        read: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> StoreResult<T> {
        let readers = self.clone();
        let busy_timeout = self.inner.busy_timeout;
        match tokio::task::spawn_blocking(move || readers.run_here(busy_timeout, read)).await {
            Ok(result) => result,
            // A panic goes on as it would have on the calling thread.
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(StoreError::Cancelled),
        }
    }

    /// Closes the idle connections, and every other one when it is given back; later reads
    /// open a connection for themselves.
    pub fn close(&self) {
        let idle = self.inner.idle.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(idle);
    }

    /// Connections open and idle.
    #[cfg(test)]
    pub fn idle(&self) -> usize {
        self.inner.idle.lock().unwrap().as_ref().map_or(0, Vec::len)
    }

    /// Runs `read` on a connection on this thread, waiting up to `busy_timeout` for a lock.
    fn run_here<T>(
        &self,
        busy_timeout: Duration,
        read: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> StoreResult<T> {
        let connection = self.take()?;
        let result = connection.busy_timeout(busy_timeout).and_then(|()| read(&connection));
        self.give_back(connection);
        result.map_err(StoreError::from)
    }

    fn take(&self) -> StoreResult<Connection> {
        if let Some(connection) = self.inner.idle.lock().unwrap_or_else(|p| p.into_inner()).as_mut().and_then(Vec::pop)
        {
            return Ok(connection);
        }
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let connection = Connection::open_with_flags(&self.inner.path, flags)?;
        connection.set_prepared_statement_cache_capacity(CACHED_STATEMENTS);
        Ok(connection)
    }

    fn give_back(&self, connection: Connection) {
        let mut idle = self.inner.idle.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(idle) = idle.as_mut().filter(|idle| idle.len() < IDLE_CONNECTIONS) {
            idle.push(connection);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test]
    async fn a_read_that_meets_a_lock_waits_for_it_off_the_runtime_thread() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("locked.db");
        // Another process's view: a connection that holds the database exclusively.
        let holder = Connection::open(&path).unwrap();
        holder
            .execute_batch(
                "PRAGMA journal_mode=WAL; PRAGMA locking_mode=EXCLUSIVE;
                 CREATE TABLE t (x INTEGER); INSERT INTO t VALUES (7);",
            )
            .unwrap();
        let readers = Readers::new(&path, Duration::from_secs(30));
        let attempts = Arc::new(AtomicUsize::new(0));
        let counted = attempts.clone();
        let read = move |c: &Connection| {
            counted.fetch_add(1, Ordering::SeqCst);
            c.query_row("SELECT x FROM t", (), |row| row.get::<_, i64>(0))
        };
        let pending = tokio::spawn({
            let readers = readers.clone();
            async move { readers.run(read).await }
        });
        // The first attempt, on the runtime thread, finds the lock and does not wait for it.
        while attempts.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        assert!(!pending.is_finished());
        drop(holder);
        // The second, on the blocking pool, waited and reads.
        assert_eq!(pending.await.unwrap().unwrap(), 7);
        assert_eq!(attempts.load(Ordering::SeqCst), 2);
        // Any other failure is the read's error.
        let missing = readers.run(|c| c.query_row("SELECT x FROM nowhere", (), |row| row.get::<_, i64>(0))).await;
        assert!(matches!(missing, Err(StoreError::Sqlite(_))), "{missing:?}");
    }
}
