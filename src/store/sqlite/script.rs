//! A write as one SQL script: several statements with their arguments, built in one place
//! and run one after another on the writer connection, each prepared once and cached.

use rusqlite::Connection;
use rusqlite::types::Value as Column;

use crate::store::sql::Value;

#[derive(Default)]
pub(super) struct Script {
    sql: String,
    args: Vec<Value>,
}

impl Script {
    /// SQL text; its `?` placeholders take the values bound next, in order. Every statement
    /// ends with `;`, and no statement has a `;` inside it (the script is split there).
    pub(super) fn sql(&mut self, text: &str) -> &mut Script {
        self.sql.push_str(text);
        self
    }

    pub(super) fn bind(&mut self, value: impl Into<Value>) -> &mut Script {
        self.args.push(value.into());
        self
    }

    /// Runs every statement (inside the connection's open transaction); the first column of
    /// every row of every statement, in order.
    pub(super) fn run(&self, c: &Connection) -> rusqlite::Result<Vec<Column>> {
        let mut args = self.args.iter();
        let mut rows = Vec::new();
        for text in self.sql.split(';').map(str::trim).filter(|s| !s.is_empty()) {
            let mut statement = c.prepare_cached(text)?;
            for i in 1..=statement.parameter_count() {
                let value = args.next().ok_or(rusqlite::Error::InvalidParameterCount(i, self.args.len()))?;
                statement.raw_bind_parameter(i, value)?;
            }
            let mut answered = statement.raw_query();
            while let Some(row) = answered.next()? {
                rows.push(row.get(0)?);
            }
        }
        Ok(rows)
    }
}
