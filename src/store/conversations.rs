//! Conversation rows: create, read, list, rename, delete.

use sqlx::sqlite::SqliteRow;
use sqlx::{FromRow, Row};

use super::{Store, StoreError, StoreResult};
use crate::wire::{ConversationMeta, ConversationStatus};

pub(super) struct ConversationRow {
    id: String,
    title: String,
    status: String,
    model: Option<String>,
    created_at: i64,
    last_activity_at: i64,
}

impl FromRow<'_, SqliteRow> for ConversationRow {
    fn from_row(row: &SqliteRow) -> sqlx::Result<Self> {
        Ok(ConversationRow {
            id: row.try_get("id")?,
            title: row.try_get("title")?,
            status: row.try_get("status")?,
            model: row.try_get("model")?,
            created_at: row.try_get("created_at")?,
            last_activity_at: row.try_get("last_activity_at")?,
        })
    }
}

impl TryFrom<ConversationRow> for ConversationMeta {
    type Error = StoreError;

    fn try_from(r: ConversationRow) -> StoreResult<Self> {
        Ok(ConversationMeta {
            status: super::status_of(&r.status)?,
            id: r.id,
            created_at: r.created_at,
            last_activity_at: r.last_activity_at,
            title: r.title,
            model: r.model,
        })
    }
}

const META_COLUMNS: &str = "id, title, status, model, created_at, last_activity_at";

pub struct NewConversation<'a> {
    pub id: &'a str,
    pub title: &'a str,
    pub model: Option<&'a str>,
    pub now: i64,
}

/// What `GET /conversations` asks for; every part optional.
#[derive(Debug, Default)]
pub struct ConversationFilter {
    pub id_prefix: Option<String>,
    pub statuses: Vec<ConversationStatus>,
    pub limit: u32,
}

impl Store {
    pub async fn create_conversation(&self, c: NewConversation<'_>) -> StoreResult<ConversationMeta> {
        let result = self.write_create_conversation(c).await;
        self.noted(result)
    }

    async fn write_create_conversation(&self, c: NewConversation<'_>) -> StoreResult<ConversationMeta> {
        let result = sqlx::query(
            "INSERT INTO conversations (id, title, model, created_at, last_activity_at)
             VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
        )
        .bind(c.id)
        .bind(c.title)
        .bind(c.model)
        .bind(c.now)
        .bind(c.now)
        .execute(&self.writer)
        .await?;
        if result.rows_affected() == 0 {
            return Err(StoreError::Exists);
        }
        Ok(ConversationMeta {
            id: c.id.to_owned(),
            created_at: c.now,
            last_activity_at: c.now,
            title: c.title.to_owned(),
            status: ConversationStatus::Idle,
            model: c.model.map(str::to_owned),
        })
    }

    pub async fn conversation(&self, id: &str) -> StoreResult<Option<ConversationMeta>> {
        let sql = format!("SELECT {META_COLUMNS} FROM conversations WHERE id = ?");
        let row: Option<ConversationRow> =
            sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(id).fetch_optional(&self.reader).await?;
        row.map(TryInto::try_into).transpose()
    }

    /// Newest activity first.
    pub async fn list_conversations(&self, f: &ConversationFilter) -> StoreResult<Vec<ConversationMeta>> {
        let mut sql = format!("SELECT {META_COLUMNS} FROM conversations WHERE 1 = 1");
        if f.id_prefix.is_some() {
            // Ids only use characters below U+007F, so every id with the prefix sorts in
            // [prefix, prefix + U+007F): a range the primary key answers.
            sql.push_str(" AND id >= ? AND id < ?");
        }
        if !f.statuses.is_empty() {
            // Values are bound, only the placeholders are generated.
            let marks = vec!["?"; f.statuses.len()].join(", ");
            sql.push_str(&format!(" AND status IN ({marks})"));
        }
        sql.push_str(" ORDER BY last_activity_at DESC, id LIMIT ?");
        let mut q = sqlx::query_as::<_, ConversationRow>(sqlx::AssertSqlSafe(sql));
        if let Some(prefix) = &f.id_prefix {
            q = q.bind(prefix).bind(format!("{prefix}\u{7f}"));
        }
        for s in &f.statuses {
            q = q.bind(s.as_str());
        }
        let rows = q.bind(i64::from(f.limit)).fetch_all(&self.reader).await?;
        rows.into_iter().map(TryInto::try_into).collect()
    }

    /// Returns false when the conversation does not exist.
    pub async fn set_title(&self, id: &str, title: &str) -> StoreResult<bool> {
        let result = self.write_set_title(id, title).await;
        self.noted(result)
    }

    async fn write_set_title(&self, id: &str, title: &str) -> StoreResult<bool> {
        let r = sqlx::query("UPDATE conversations SET title = ? WHERE id = ?")
            .bind(title)
            .bind(id)
            .execute(&self.writer)
            .await?;
        Ok(r.rows_affected() > 0)
    }

    /// Deletes the conversation with its log and turns; false when it did not exist.
    pub async fn delete_conversation(&self, id: &str) -> StoreResult<bool> {
        let result = self.write_delete_conversation(id).await;
        self.noted(result)
    }

    async fn write_delete_conversation(&self, id: &str) -> StoreResult<bool> {
        let r = sqlx::query("DELETE FROM conversations WHERE id = ?").bind(id).execute(&self.writer).await?;
        Ok(r.rows_affected() > 0)
    }

    /// Marks a conversation closed; false when it does not exist.
    pub async fn close_conversation(&self, id: &str) -> StoreResult<bool> {
        let result = self.write_close_conversation(id).await;
        self.noted(result)
    }

    async fn write_close_conversation(&self, id: &str) -> StoreResult<bool> {
        let r = sqlx::query("UPDATE conversations SET status = 'closed' WHERE id = ?")
            .bind(id)
            .execute(&self.writer)
            .await?;
        Ok(r.rows_affected() > 0)
    }

    /// Sets (or clears) one of the conversation's settings, creating the conversation when
    /// missing.
    pub async fn set_setting(&self, id: &str, setting: Setting, value: Option<&str>, now: i64) -> StoreResult<()> {
        let result = self.write_set_setting(id, setting, value, now).await;
        self.noted(result)
    }

    async fn write_set_setting(&self, id: &str, setting: Setting, value: Option<&str>, now: i64) -> StoreResult<()> {
        let column = setting.column();
        let sql = format!(
            "INSERT INTO conversations (id, {column}, created_at, last_activity_at) VALUES (?1, ?2, ?3, ?3)
             ON CONFLICT (id) DO UPDATE SET {column} = ?2"
        );
        sqlx::query(sqlx::AssertSqlSafe(sql)).bind(id).bind(value).bind(now).execute(&self.writer).await?;
        Ok(())
    }

    /// One of the conversation's settings (`None` for an unknown conversation, or one without
    /// it set).
    pub async fn setting(&self, id: &str, setting: Setting) -> StoreResult<Option<String>> {
        Ok(self.settings(id).await?.get(setting).map(str::to_owned))
    }

    /// Every setting of the conversation (all `None` for an unknown one).
    pub async fn settings(&self, id: &str) -> StoreResult<Settings> {
        let row: Option<(Option<String>, Option<String>, Option<String>)> =
            sqlx::query_as("SELECT model, cwd, reasoning_effort FROM conversations WHERE id = ?")
                .bind(id)
                .fetch_optional(&self.reader)
                .await?;
        let (model, cwd, reasoning_effort) = row.unwrap_or_default();
        Ok(Settings { model, cwd, reasoning_effort })
    }
}

/// A per-conversation setting a turn falls back to when its request names none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    Model,
    Cwd,
    ReasoningEffort,
}

impl Setting {
    fn column(self) -> &'static str {
        match self {
            Setting::Model => "model",
            Setting::Cwd => "cwd",
            Setting::ReasoningEffort => "reasoning_effort",
        }
    }
}

/// A conversation's settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settings {
    pub model: Option<String>,
    pub cwd: Option<String>,
    pub reasoning_effort: Option<String>,
}

impl Settings {
    pub fn get(&self, setting: Setting) -> Option<&str> {
        match setting {
            Setting::Model => self.model.as_deref(),
            Setting::Cwd => self.cwd.as_deref(),
            Setting::ReasoningEffort => self.reasoning_effort.as_deref(),
        }
    }
}
