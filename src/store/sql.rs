//! A statement with its values, written once for both backends: `$n` placeholders, values
//! bound by number, rows decoded into tuples. SQLite runs it on rusqlite (reads on the reader
//! connections, writes on the writer thread), PostgreSQL on sqlx's pool.

use std::borrow::Cow;

use super::{Backend, Store, StoreResult};

/// A value bound to a statement.
#[derive(Debug)]
pub(super) enum Value {
    Int(i64),
    Real(f64),
    /// Text, or NULL (typed as text for PostgreSQL).
    Text(Option<String>),
}

impl From<i64> for Value {
    fn from(v: i64) -> Value {
        Value::Int(v)
    }
}

/// NULL is bound as text (see `Value::Text`): for a column SQLite types by its value, not for
/// a PostgreSQL integer one.
impl From<Option<i64>> for Value {
    fn from(v: Option<i64>) -> Value {
        v.map_or(Value::Text(None), Value::Int)
    }
}

impl From<f64> for Value {
    fn from(v: f64) -> Value {
        Value::Real(v)
    }
}

impl From<Option<f64>> for Value {
    fn from(v: Option<f64>) -> Value {
        v.map_or(Value::Text(None), Value::Real)
    }
}

impl From<bool> for Value {
    fn from(v: bool) -> Value {
        Value::Int(i64::from(v))
    }
}

impl From<&str> for Value {
    fn from(v: &str) -> Value {
        Value::Text(Some(v.to_owned()))
    }
}

impl From<&String> for Value {
    fn from(v: &String) -> Value {
        Value::Text(Some(v.clone()))
    }
}

impl From<String> for Value {
    fn from(v: String) -> Value {
        Value::Text(Some(v))
    }
}

impl From<Option<&str>> for Value {
    fn from(v: Option<&str>) -> Value {
        Value::Text(v.map(str::to_owned))
    }
}

impl rusqlite::ToSql for Value {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        match self {
            Value::Int(v) => v.to_sql(),
            Value::Real(v) => v.to_sql(),
            Value::Text(v) => v.to_sql(),
        }
    }
}

/// A column both drivers decode.
#[cfg(not(feature = "cluster"))]
pub(super) trait Column: rusqlite::types::FromSql + Send + 'static {}
#[cfg(not(feature = "cluster"))]
impl<T: rusqlite::types::FromSql + Send + 'static> Column for T {}

/// A column both drivers decode.
#[cfg(feature = "cluster")]
pub(super) trait Column:
    rusqlite::types::FromSql + for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + 'static
{
}
#[cfg(feature = "cluster")]
impl<T> Column for T where
    T: rusqlite::types::FromSql
        + for<'r> sqlx::Decode<'r, sqlx::Postgres>
        + sqlx::Type<sqlx::Postgres>
        + Send
        + 'static
{
}

/// A row decoded by column position.
pub(super) trait FromRow: Sized + Send + 'static {
    fn sqlite(row: &rusqlite::Row<'_>) -> rusqlite::Result<Self>;
    #[cfg(feature = "cluster")]
    fn postgres(row: &sqlx::postgres::PgRow) -> Result<Self, sqlx::Error>;
}

macro_rules! tuple_row {
    ($($t:ident $i:tt),+) => {
        impl<$($t: Column),+> FromRow for ($($t,)+) {
            fn sqlite(row: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
                Ok(($(row.get::<_, $t>($i)?,)+))
            }
            #[cfg(feature = "cluster")]
            fn postgres(row: &sqlx::postgres::PgRow) -> Result<Self, sqlx::Error> {
                use sqlx::Row;
                Ok(($(row.try_get::<$t, _>($i)?,)+))
            }
        }
    };
}
tuple_row!(A 0);
tuple_row!(A 0, B 1);
tuple_row!(A 0, B 1, C 2);
tuple_row!(A 0, B 1, C 2, D 3);
tuple_row!(A 0, B 1, C 2, D 3, E 4);
tuple_row!(A 0, B 1, C 2, D 3, E 4, F 5);
tuple_row!(A 0, B 1, C 2, D 3, E 4, F 5, G 6);
tuple_row!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);

/// SQL text with `$1`, `$2`... placeholders and the values they take.
#[derive(Debug)]
pub(super) struct Query {
    sql: Cow<'static, str>,
    values: Vec<Value>,
}

impl Query {
    pub(super) fn new(sql: impl Into<Cow<'static, str>>) -> Query {
        Query { sql: sql.into(), values: Vec::new() }
    }

    /// The next placeholder's value (`$1` first).
    pub(super) fn bind(mut self, value: impl Into<Value>) -> Query {
        self.values.push(value.into());
        self
    }

    /// Prepares the statement on `c` (cached) and binds each `$n` to the nth value: SQLite
    /// numbers named parameters by first appearance, so they are looked up by name.
    fn sqlite_statement<'c>(&self, c: &'c rusqlite::Connection) -> rusqlite::Result<rusqlite::CachedStatement<'c>> {
        let mut statement = c.prepare_cached(&self.sql)?;
        for i in 1..=statement.parameter_count() {
            let value = statement
                .parameter_name(i)
                .and_then(|name| name.strip_prefix('$'))
                .and_then(|n| n.parse::<usize>().ok())
                .and_then(|n| self.values.get(n.checked_sub(1)?))
                .ok_or(rusqlite::Error::InvalidParameterCount(i, self.values.len()))?;
            statement.raw_bind_parameter(i, value)?;
        }
        Ok(statement)
    }

    /// The rows, decoded, on a SQLite connection.
    pub(super) fn sqlite_rows<R: FromRow>(&self, c: &rusqlite::Connection) -> rusqlite::Result<Vec<R>> {
        let mut statement = self.sqlite_statement(c)?;
        let mut rows = statement.raw_query();
        let mut out = Vec::new();
        while let Some(row) = rows.next()? {
            out.push(R::sqlite(row)?);
        }
        Ok(out)
    }

    /// Rows changed, on a SQLite connection.
    pub(super) fn sqlite_execute(&self, c: &rusqlite::Connection) -> rusqlite::Result<u64> {
        Ok(self.sqlite_statement(c)?.raw_execute()? as u64)
    }

    #[cfg(feature = "cluster")]
    fn postgres(&self) -> sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments> {
        let mut q = sqlx::query(sqlx::AssertSqlSafe(self.sql.as_ref()));
        for value in &self.values {
            q = match value {
                Value::Int(v) => q.bind(*v),
                Value::Real(v) => q.bind(*v),
                Value::Text(v) => q.bind(v.as_deref()),
            };
        }
        q
    }

    /// The rows, decoded, on a PostgreSQL connection or pool.
    #[cfg(feature = "cluster")]
    pub(super) async fn postgres_rows<'c, R: FromRow>(
        &self,
        executor: impl sqlx::PgExecutor<'c>,
    ) -> Result<Vec<R>, sqlx::Error> {
        self.postgres().fetch_all(executor).await?.iter().map(R::postgres).collect()
    }

    /// Rows changed, on a PostgreSQL connection or pool.
    #[cfg(feature = "cluster")]
    pub(super) async fn postgres_execute<'c>(&self, executor: impl sqlx::PgExecutor<'c>) -> Result<u64, sqlx::Error> {
        Ok(self.postgres().execute(executor).await?.rows_affected())
    }
}

impl Store {
    /// Reads the first row of a short lookup, if any (SQLite: where it is awaited, see
    /// `readers`).
    ///
    /// Boxed: a stream's task awaits one of these when it starts (`latest_seq`), and a future
    /// awaited inline makes every future that awaits it, the stream's own, as big as its
    /// largest state for the stream's whole life (W4's memory per idle stream shows it).
    pub(super) async fn fetch_optional<R: FromRow>(&self, q: Query) -> StoreResult<Option<R>> {
        let rows: Vec<R> = Box::pin(async move {
            StoreResult::Ok(match &self.backend {
                Backend::Sqlite(b) => b.readers.run(move |c| q.sqlite_rows(c)).await?,
                #[cfg(feature = "cluster")]
                Backend::Postgres(b) => q.postgres_rows(&b.pool).await?,
            })
        })
        .await?;
        Ok(rows.into_iter().next())
    }

    /// Reads every row (SQLite: on tokio's blocking pool, as the rows may be many). Boxed, as
    /// `fetch_optional` is.
    pub(super) async fn fetch_all<R: FromRow>(&self, q: Query) -> StoreResult<Vec<R>> {
        Box::pin(async move {
            Ok(match &self.backend {
                Backend::Sqlite(b) => b.readers.run_blocking(move |c| q.sqlite_rows(c)).await?,
                #[cfg(feature = "cluster")]
                Backend::Postgres(b) => q.postgres_rows(&b.pool).await?,
            })
        })
        .await
    }

    /// Which of `names` a lookup finds: `sql` reads one text column and holds `{list}` where
    /// the names go (`$2, $3, ...`; `$1` is `first`). Asked 500 names at a time, so that no
    /// statement passes either backend's bound on values.
    pub(super) async fn found_among(&self, sql: &str, first: i64, names: &[&str]) -> StoreResult<Vec<String>> {
        let mut found = Vec::new();
        for some in names.chunks(500) {
            let list = (2..some.len() + 2).map(|n| format!("${n}")).collect::<Vec<_>>().join(", ");
            let q = some.iter().fold(Query::new(sql.replace("{list}", &list)).bind(first), |q, name| q.bind(*name));
            found.extend(self.fetch_all::<(String,)>(q).await?.into_iter().map(|(name,)| name));
        }
        Ok(found)
    }

    /// Runs a write outside the turns' writer task (SQLite: on the writer connection);
    /// answers the rows it changed. A refusal is recorded (see `noted`).
    pub(super) async fn execute(&self, q: Query) -> StoreResult<u64> {
        let result = match &self.backend {
            Backend::Sqlite(b) => b.writer.run(move |c| Ok(q.sqlite_execute(c)?)).await,
            #[cfg(feature = "cluster")]
            Backend::Postgres(b) => q.postgres_execute(&b.pool).await.map_err(Into::into),
        };
        self.noted(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `$n` takes the nth value wherever it first appears (SQLite alone would number the
    /// placeholders in the order they appear), and a placeholder without a value is an error,
    /// not a NULL.
    #[test]
    fn placeholders_take_their_numbered_value_on_sqlite() {
        let c = rusqlite::Connection::open_in_memory().unwrap();
        let q = Query::new("SELECT $2, $1, $2 || $1").bind(7).bind("x");
        let rows: Vec<(String, i64, String)> = q.sqlite_rows(&c).unwrap();
        assert_eq!(rows, vec![("x".to_owned(), 7, "x7".to_owned())]);
        let missing = Query::new("SELECT $1, $3").bind(1).bind(2).sqlite_rows::<(i64, i64)>(&c);
        assert!(matches!(missing, Err(rusqlite::Error::InvalidParameterCount(..))), "{missing:?}");
        let unnumbered = Query::new("SELECT ?").bind(1).sqlite_rows::<(i64,)>(&c);
        assert!(unnumbered.is_err(), "{unnumbered:?}");
    }
}
