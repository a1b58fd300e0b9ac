//! A consistent copy of a gateway's SQLite database in a new file, taken while a gateway may
//! be writing to it (`--backup`; docs/storage.md, "Backups").
//!
//! `VACUUM INTO` reads the database in one read transaction: in WAL mode that is a snapshot
//! of everything committed when it began, and the gateway's writes go on meanwhile. The copy
//! is written beside its name, synced, checked, and only then given its name, so a file with
//! that name is always a whole backup.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error("--backup copies a SQLite database; back up a PostgreSQL one with pg_dump")]
    NotSqlite,
    #[error("there is no database at {0}")]
    Missing(PathBuf),
    #[error("{0} is not a dispatch-gateway database")]
    NotGateway(PathBuf),
    #[error("{0} exists: a backup goes to a new file")]
    Exists(PathBuf),
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("cannot write the backup {path}")]
    Write { path: PathBuf, source: Box<dyn std::error::Error + Send + Sync> },
    #[error("the copy failed SQLite's check: {0}")]
    Check(String),
}

/// Copies the database at `from` into the new file `to`; the copy's size in bytes. A lock
/// held by a writer is waited for up to `busy_timeout`.
pub fn backup(from: &Path, to: &Path, busy_timeout: Duration) -> Result<u64, BackupError> {
    if to.exists() {
        return Err(BackupError::Exists(to.to_owned()));
    }
    let folder = to.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !folder.is_dir() {
        return Err(BackupError::Write { path: to.to_owned(), source: "its folder does not exist".into() });
    }
    if !from.is_file() {
        return Err(BackupError::Missing(from.to_owned()));
    }
    // Read-write but never created: a read-only connection fails on a WAL database whose
    // shared-memory index it could create (no gateway has it open). SQLite opens a file the
    // user may only read read-only, which works while a gateway has the database open.
    let source =
        Connection::open_with_flags(from, OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX)?;
    source.busy_timeout(busy_timeout)?;
    let tables: i64 = source
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name IN ('_sqlx_migrations', 'conversations', 'chunks')",
            [],
            |row| row.get(0),
        )
        .map_err(|e| match e {
            rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::NotADatabase => {
                BackupError::NotGateway(from.to_owned())
            }
            e => e.into(),
        })?;
    if tables != 3 {
        return Err(BackupError::NotGateway(from.to_owned()));
    }
    let mut partial = to.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let io = |source: std::io::Error| BackupError::Write { path: to.to_owned(), source: source.into() };
    // What an earlier backup to the same name left when it was stopped part way.
    if let Err(e) = std::fs::remove_file(&partial)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        return Err(io(e));
    }
    let written = copy(&source, &partial).map_err(|e| BackupError::Write { path: to.to_owned(), source: e });
    let written = written.and_then(|()| check(&partial));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&partial);
        return Err(e);
    }
    // VACUUM INTO does not sync what it wrote.
    std::fs::File::open(&partial).and_then(|f| f.sync_all()).map_err(io)?;
    let bytes = std::fs::metadata(&partial).map_err(io)?.len();
    std::fs::rename(&partial, to).map_err(io)?;
    std::fs::File::open(folder).and_then(|f| f.sync_all()).map_err(io)?;
    Ok(bytes)
}

fn copy(source: &Connection, to: &Path) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let to = to.to_str().ok_or("the path is not UTF-8")?;
    source.execute("VACUUM INTO ?1", [to])?;
    Ok(())
}

/// SQLite's own check of the copy's pages and indexes.
fn check(copy: &Path) -> Result<(), BackupError> {
    let copy = Connection::open_with_flags(copy, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)?;
    let verdict: String = copy.query_row("PRAGMA quick_check", [], |row| row.get(0))?;
    if verdict != "ok" {
        return Err(BackupError::Check(verdict));
    }
    Ok(())
}
