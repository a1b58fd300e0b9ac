//! Reads on SQLite connections of their own, run on the calling thread.
//!
//! sqlx's SQLite driver runs every statement on a thread per connection: a query is a message
//! to that thread and its rows are messages back, and the connection goes back to its pool
//! through a task of its own. For a history window (tens of microseconds of SQLite work) those
//! hand-offs cost as much as the query. These connections are opened read-only on
//! the same file (WAL: readers never wait for the writer and see only committed
//! transactions), and a bounded read runs where it is awaited, like any other short piece of
//! CPU work; a read without a bound goes to tokio's blocking pool.

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

    /// Runs `read` on a connection on this thread: for reads whose work is bounded and small.
    pub fn run<T>(&self, read: impl FnOnce(&Connection) -> rusqlite::Result<T>) -> StoreResult<T> {
        let connection = self.take()?;
        let result = read(&connection);
        self.give_back(connection);
        result.map_err(StoreError::from)
    }

    /// Runs `read` on tokio's blocking pool: for reads of any size.
    pub async fn run_blocking<T: Send + 'static>(
        &self,
        read: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> StoreResult<T> {
        let readers = self.clone();
        match tokio::task::spawn_blocking(move || readers.run(read)).await {
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

    fn take(&self) -> StoreResult<Connection> {
        if let Some(connection) = self.inner.idle.lock().unwrap_or_else(|p| p.into_inner()).as_mut().and_then(Vec::pop)
        {
            return Ok(connection);
        }
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let connection = Connection::open_with_flags(&self.inner.path, flags)?;
        connection.busy_timeout(self.inner.busy_timeout)?;
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
