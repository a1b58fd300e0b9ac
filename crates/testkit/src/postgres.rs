//! Fresh PostgreSQL databases for tests that run against a real server.
//!
//! `DISPATCH_TEST_POSTGRES` names the server: the URL of a database the tests may connect to
//! as a user that may create databases (CI starts one, see `.ci/run`). Unset, the tests (or
//! their PostgreSQL half) are skipped with a line saying so, unless
//! `DISPATCH_REQUIRE_POSTGRES=1` asks for them, which makes a missing server a failure.

use std::sync::atomic::{AtomicU32, Ordering};

use sqlx::{Connection, Executor, PgConnection};

/// A database made for one test, dropped (with any connection still open) when this is.
pub struct FreshDatabase {
    pub url: String,
    /// The server's URL the database was made from (`DISPATCH_TEST_POSTGRES`).
    pub admin: String,
    pub name: String,
}

/// A new, empty database, or `None` when no server is configured (see the module's note).
pub async fn fresh_database() -> Option<FreshDatabase> {
    let Ok(admin) = std::env::var("DISPATCH_TEST_POSTGRES") else {
        assert!(
            std::env::var("DISPATCH_REQUIRE_POSTGRES").as_deref() != Ok("1"),
            "DISPATCH_REQUIRE_POSTGRES=1 but DISPATCH_TEST_POSTGRES does not name a PostgreSQL server"
        );
        eprintln!("DISPATCH_TEST_POSTGRES is unset: skipping what needs PostgreSQL");
        return None;
    };
    static MADE: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().subsec_nanos();
    let name = format!("dispatch_test_{}_{}_{nanos}", std::process::id(), MADE.fetch_add(1, Ordering::Relaxed));
    let mut conn = PgConnection::connect(&admin).await.unwrap_or_else(|e| panic!("DISPATCH_TEST_POSTGRES: {e}"));
    conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).await.expect("CREATE DATABASE");
    let _ = conn.close().await;
    Some(FreshDatabase { url: with_database(&admin, &name), admin, name })
}

/// `url` with its database name replaced by `name` (a query string kept).
fn with_database(url: &str, name: &str) -> String {
    let authority = url.find("://").map_or(0, |i| i + 3);
    let (base, query) = match url.find('?') {
        Some(q) => url.split_at(q),
        None => (url, ""),
    };
    let host_end = base[authority..].find('/').map_or(base.len(), |i| authority + i);
    format!("{}/{name}{query}", &base[..host_end])
}

impl Drop for FreshDatabase {
    fn drop(&mut self) {
        let (admin, name) = (self.admin.clone(), self.name.clone());
        // Drop runs inside the test's runtime, which cannot be blocked on: a thread of its own.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            runtime.block_on(async {
                let mut conn = PgConnection::connect(&admin).await.ok()?;
                conn.execute(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))).await.ok()
            })
        });
        let _ = dropped.join();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_database_name_is_replaced_and_the_rest_kept() {
        let with = super::with_database;
        assert_eq!(with("postgres://u@h:5432/postgres", "x"), "postgres://u@h:5432/x");
        assert_eq!(with("postgres://u:p@h/postgres?sslmode=disable", "x"), "postgres://u:p@h/x?sslmode=disable");
        assert_eq!(with("postgres://h", "x"), "postgres://h/x");
    }
}
