//! Where the data lives, as the configuration names it.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// Where the data lives: a SQLite file or a PostgreSQL database, chosen by the configuration's
/// `database` value (a path, `sqlite://PATH`, or a `postgres://` URL).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Database {
    /// The file (created with its folder when missing).
    Sqlite(PathBuf),
    /// A connection URL (`postgres://` or `postgresql://`).
    Postgres(String),
}

impl FromStr for Database {
    type Err = String;

    fn from_str(s: &str) -> Result<Database, String> {
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            return Ok(Database::Postgres(s.to_owned()));
        }
        let path = s.strip_prefix("sqlite://").or_else(|| s.strip_prefix("sqlite:")).unwrap_or(s);
        if path.is_empty() {
            return Err("the database is empty: give a SQLite file or a postgres:// URL".into());
        }
        if let Some((scheme, _)) = path.split_once("://") {
            return Err(format!("unknown database scheme {scheme:?}: give a SQLite file or a postgres:// URL"));
        }
        Ok(Database::Sqlite(PathBuf::from(path)))
    }
}

/// For logs: a URL's password is not shown.
impl fmt::Display for Database {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Database::Sqlite(path) => write!(f, "{}", path.display()),
            Database::Postgres(url) => f.write_str(&super::redacted(url, false)),
        }
    }
}
