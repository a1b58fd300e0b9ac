//! The key gateways on a bus sign their messages with (src/bus/sign.rs), kept where every
//! gateway of a cluster already reaches: the database.

use super::sql::Query;
use super::{Store, StoreResult};

impl Store {
    /// The key of the gateways on a bus (src/bus/sign.rs): `candidate` when none was made yet,
    /// else the one the first gateway made (two joining at once agree: one row, first wins).
    pub async fn bus_secret(&self, candidate: &str) -> StoreResult<String> {
        let sql = "INSERT INTO bus_secret (id, secret) VALUES (1, $1) ON CONFLICT (id) DO NOTHING";
        self.execute(Query::new(sql).bind(candidate)).await?;
        let row: Option<(String,)> =
            self.fetch_optional(Query::new("SELECT secret FROM bus_secret WHERE id = 1")).await?;
        Ok(row.map(|(secret,)| secret).unwrap_or_else(|| candidate.to_owned()))
    }
}
