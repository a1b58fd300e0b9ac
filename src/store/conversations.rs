//! Conversation rows: create, read, list, rename, settings (deletion: `deletion`). A
//! conversation marked deleted is left out of every read and write here.

use super::sql::Query;
use super::{Store, StoreError, StoreResult};
use crate::wire::{ConversationMeta, ConversationStatus};

/// A conversation row's listed columns: id, title, status, model, created_at, last_activity_at,
/// owner.
type ConversationRow = (String, String, String, Option<String>, i64, i64, Option<String>);

const META_COLUMNS: &str = "id, title, status, model, created_at, last_activity_at, owner";

fn meta(
    (id, title, status, model, created_at, last_activity_at, owner): ConversationRow,
) -> StoreResult<ConversationMeta> {
    Ok(ConversationMeta { status: super::status_of(&status)?, id, created_at, last_activity_at, title, model, owner })
}

pub struct NewConversation<'a> {
    pub id: &'a str,
    pub title: &'a str,
    pub model: Option<&'a str>,
    /// The subject creating it (none with auth off).
    pub owner: Option<&'a str>,
    pub now: i64,
}

/// What `GET /conversations` asks for; every part optional.
#[derive(Debug, Default)]
pub struct ConversationFilter {
    pub id_prefix: Option<String>,
    /// Conversations whose title holds this text (letters A-Z in either case), or whose id
    /// starts with it.
    pub search: Option<String>,
    pub statuses: Vec<ConversationStatus>,
    /// Only this subject's conversations.
    pub owner: Option<String>,
    pub limit: u32,
}

/// Who owns a conversation, as far as the store knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ownership {
    /// No such conversation (or one being deleted): nobody has it.
    Unused,
    /// It exists, owned by this subject (`None`: by nobody, only administrators see it).
    Owned(Option<String>),
}

impl Store {
    pub async fn create_conversation(&self, c: NewConversation<'_>) -> StoreResult<ConversationMeta> {
        let sql = "INSERT INTO conversations (id, title, model, created_at, last_activity_at, owner)
                   VALUES ($1, $2, $3, $4, $4, $5) ON CONFLICT (id) DO NOTHING";
        let q = Query::new(sql).bind(c.id).bind(c.title).bind(c.model).bind(c.now).bind(c.owner);
        if self.execute(q).await? == 0 {
            return Err(StoreError::Exists);
        }
        Ok(ConversationMeta {
            id: c.id.to_owned(),
            created_at: c.now,
            last_activity_at: c.now,
            title: c.title.to_owned(),
            status: ConversationStatus::Idle,
            model: c.model.map(str::to_owned),
            owner: c.owner.map(str::to_owned),
        })
    }

    /// Who owns conversation `id`.
    pub async fn ownership(&self, id: &str) -> StoreResult<Ownership> {
        let sql = "SELECT owner FROM conversations WHERE id = $1 AND deleted_at IS NULL";
        let row: Option<(Option<String>,)> = self.fetch_optional(Query::new(sql).bind(id)).await?;
        Ok(row.map_or(Ownership::Unused, |(owner,)| Ownership::Owned(owner)))
    }

    pub async fn conversation(&self, id: &str) -> StoreResult<Option<ConversationMeta>> {
        let sql = format!("SELECT {META_COLUMNS} FROM conversations WHERE id = $1 AND deleted_at IS NULL");
        let row: Option<ConversationRow> = self.fetch_optional(Query::new(sql).bind(id)).await?;
        row.map(meta).transpose()
    }

    /// Newest activity first.
    pub async fn list_conversations(&self, f: &ConversationFilter) -> StoreResult<Vec<ConversationMeta>> {
        let mut sql = format!("SELECT {META_COLUMNS} FROM conversations WHERE deleted_at IS NULL");
        let mut n = 0;
        let mut next = || {
            n += 1;
            format!("${n}")
        };
        if f.id_prefix.is_some() {
            // Ids compare bytewise (PostgreSQL: COLLATE "C") and use only characters below
            // U+007F, so every id with the prefix is in [prefix, prefix + U+007F): a range the
            // primary key answers.
            sql.push_str(&format!(" AND id >= {} AND id < {}", next(), next()));
        }
        if f.owner.is_some() {
            sql.push_str(&format!(" AND owner = {}", next()));
        }
        if f.search.is_some() {
            // The title's words, whatever their case (ASCII), with the text's `%`, `_` and `\`
            // taken as themselves; or the ids with the text as their prefix (the primary key's
            // range, as `id_prefix`). A scan of the rows that the other conditions leave.
            let (title, low, high) = (next(), next(), next());
            sql.push_str(&format!(" AND (lower(title) LIKE {title} ESCAPE '\\' OR (id >= {low} AND id < {high}))"));
        }
        if !f.statuses.is_empty() {
            // Values are bound, only the placeholders are generated.
            let marks: Vec<String> = f.statuses.iter().map(|_| next()).collect();
            sql.push_str(&format!(" AND status IN ({})", marks.join(", ")));
        }
        sql.push_str(&format!(" ORDER BY last_activity_at DESC, id LIMIT {}", next()));
        let mut q = Query::new(sql);
        if let Some(prefix) = &f.id_prefix {
            q = q.bind(prefix).bind(format!("{prefix}\u{7f}"));
        }
        if let Some(owner) = &f.owner {
            q = q.bind(owner.as_str());
        }
        if let Some(text) = &f.search {
            let escaped: String = text
                .to_ascii_lowercase()
                .chars()
                .flat_map(|c| if matches!(c, '%' | '_' | '\\') { vec!['\\', c] } else { vec![c] })
                .collect();
            q = q.bind(format!("%{escaped}%")).bind(text.as_str()).bind(format!("{text}\u{7f}"));
        }
        for s in &f.statuses {
            q = q.bind(s.as_str());
        }
        let rows: Vec<ConversationRow> = self.fetch_all(q.bind(i64::from(f.limit))).await?;
        rows.into_iter().map(meta).collect()
    }

    /// Returns false when the conversation does not exist.
    pub async fn set_title(&self, id: &str, title: &str) -> StoreResult<bool> {
        self.update("UPDATE conversations SET title = $2 WHERE id = $1 AND deleted_at IS NULL", id, Some(title)).await
    }

    /// Marks a conversation closed; false when it does not exist.
    pub async fn close_conversation(&self, id: &str) -> StoreResult<bool> {
        self.update("UPDATE conversations SET status = 'closed' WHERE id = $1 AND deleted_at IS NULL", id, None).await
    }

    /// Runs a write of one conversation's row (`$1` its id, `$2` the value, when there is one);
    /// false when no row was touched.
    pub(super) async fn update(&self, sql: &'static str, id: &str, value: Option<&str>) -> StoreResult<bool> {
        let mut q = Query::new(sql).bind(id);
        if let Some(value) = value {
            q = q.bind(value);
        }
        Ok(self.execute(q).await? > 0)
    }

    /// Sets (or clears) one of the conversation's settings, creating the conversation (owned by
    /// `owner`) when missing; `Deleting` while it is being deleted.
    pub async fn set_setting(
        &self,
        id: &str,
        setting: Setting,
        value: Option<&str>,
        owner: Option<&str>,
        now: i64,
    ) -> StoreResult<()> {
        let column = setting.column();
        let sql = format!(
            "INSERT INTO conversations (id, {column}, created_at, last_activity_at, owner) VALUES ($1, $2, $3, $3, $4)
             ON CONFLICT (id) DO UPDATE SET {column} = $2 WHERE conversations.deleted_at IS NULL"
        );
        match self.execute(Query::new(sql).bind(id).bind(value).bind(now).bind(owner)).await? {
            0 => Err(StoreError::Deleting),
            _ => Ok(()),
        }
    }

    /// One of the conversation's settings (`None` for an unknown conversation, or one without
    /// it set).
    pub async fn setting(&self, id: &str, setting: Setting) -> StoreResult<Option<String>> {
        Ok(self.settings(id).await?.get(setting).map(str::to_owned))
    }

    /// Every setting of the conversation (all `None` for an unknown one).
    pub async fn settings(&self, id: &str) -> StoreResult<Settings> {
        let sql = "SELECT model, cwd, reasoning_effort, owner FROM conversations WHERE id = $1 AND deleted_at IS NULL";
        type Row = (Option<String>, Option<String>, Option<String>, Option<String>);
        let row: Option<Row> = self.fetch_optional(Query::new(sql).bind(id)).await?;
        let ownership = match &row {
            Some((_, _, _, owner)) => Ownership::Owned(owner.clone()),
            None => Ownership::Unused,
        };
        let (model, cwd, reasoning_effort, _) = row.unwrap_or_default();
        Ok(Settings { model, cwd, reasoning_effort, ownership })
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

/// A conversation's settings, and who owns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub model: Option<String>,
    pub cwd: Option<String>,
    pub reasoning_effort: Option<String>,
    pub ownership: Ownership,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::every_backend;

    /// A search finds a word of a title in any case, or an id by its prefix, and takes `%`, `_`
    /// and `\` as themselves, on both backends.
    #[tokio::test]
    async fn a_search_finds_title_words_in_any_case_and_id_prefixes() {
        for t in every_backend().await {
            let (store, b) = (&t.store, t.backend);
            for (id, title) in
                [("a1", "Five hundred turns"), ("b2", "100% sure_thing"), ("five-x", "other"), ("c3", "x")]
            {
                let new = NewConversation { id, title, model: None, owner: None, now: 1 };
                store.create_conversation(new).await.unwrap();
            }
            let found = |text: &'static str| async move {
                let filter = ConversationFilter { search: Some(text.into()), limit: 10, ..Default::default() };
                let mut ids: Vec<String> =
                    store.list_conversations(&filter).await.unwrap().into_iter().map(|c| c.id).collect();
                ids.sort();
                ids
            };
            assert_eq!(found("HUNDRED").await, ["a1"], "{b}");
            assert_eq!(found("five").await, ["a1", "five-x"], "{b}: a title word, or an id prefix");
            assert_eq!(found("0%").await, ["b2"], "{b}");
            assert_eq!(found("e_t").await, ["b2"], "{b}");
            assert!(found("e%t").await.is_empty(), "{b}: % is a percent sign");
            assert!(found("x_").await.is_empty(), "{b}: _ is an underscore");
            assert!(found("nothing").await.is_empty(), "{b}");
        }
    }
}
