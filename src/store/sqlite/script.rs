//! A write as one SQL script: several statements with their arguments, sent to the database
//! thread in one round trip. Under load a round trip costs far more than SQLite's own work for
//! a statement (the thread has to be woken and scheduled, then the task that waits for it), so
//! each write of a turn (open, append, seal) is one script rather than one trip per statement.

use sqlx::sqlite::{SqliteArguments, SqliteRow};
use sqlx::{Arguments, Encode, Sqlite, SqliteConnection, Type};

use super::{StoreError, StoreResult};

#[derive(Default)]
pub(super) struct Script {
    sql: String,
    args: SqliteArguments,
}

impl Script {
    /// SQL text; its `?` placeholders take the values bound next, in order. (Only `?`: sqlx
    /// reads a numbered `?N` as the script's Nth value, whichever statement it is in.)
    pub(super) fn sql(&mut self, text: &str) -> &mut Script {
        self.sql.push_str(text);
        self
    }

    pub(super) fn bind<'t, T: Encode<'t, Sqlite> + Type<Sqlite> + 't>(&mut self, value: T) -> &mut Script {
        // Encoding into SQLite's argument buffer cannot fail for the types used here.
        self.args.add(value).expect("an SQLite argument encodes");
        self
    }

    /// Runs every statement in the connection's open transaction; the rows of every
    /// statement, in order.
    pub(super) async fn run(self, conn: &mut SqliteConnection) -> StoreResult<Vec<SqliteRow>> {
        sqlx::query_with(sqlx::AssertSqlSafe(self.sql), self.args).fetch_all(conn).await.map_err(StoreError::from)
    }
}
