//! Conversation rows: create, read, list, rename, settings (deletion: `deletion`). A
//! conversation marked deleted is left out of every read and write here.

use super::sql::{Query, Value};
use super::{Store, StoreError, StoreResult};
use crate::wire::{ConversationMeta, ConversationStatus};

/// A conversation row's listed columns: id, title, status, model, created_at, last_activity_at,
/// owner, and why its newest ended turn ended.
type ConversationRow = (String, String, String, Option<String>, i64, i64, Option<String>, Option<String>);

/// The last column reads the newest turn that ended (sealed, or cut off by a crash: `error`)
/// backwards along `turns_by_ordinal`: the running turn, if any, and then one row.
const META_COLUMNS: &str = "id, title, status, model, created_at, last_activity_at, owner,
    (SELECT coalesce(t.reason, 'error') FROM turns t
     WHERE t.conversation_id = conversations.id AND (t.sealed_at IS NOT NULL OR t.interrupted_at IS NOT NULL)
     ORDER BY t.ordinal DESC LIMIT 1)";

fn meta(
    (id, title, status, model, created_at, last_activity_at, owner, last_reason): ConversationRow,
) -> StoreResult<ConversationMeta> {
    let status = super::status_of(&status)?;
    Ok(ConversationMeta { status, id, created_at, last_activity_at, title, model, owner, last_reason })
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
    /// The page after this row (its last activity and id): the conversations listed after it.
    pub after: Option<(i64, String)>,
    pub limit: u32,
}

impl ConversationFilter {
    /// What the filter asks, as SQL after `WHERE` (the page's place left out: a count reads
    /// every page) and the values of its `$n`.
    fn conditions(&self) -> (String, Vec<Value>) {
        let mut sql = String::from("deleted_at IS NULL");
        let mut values: Vec<Value> = Vec::new();
        let mut mark = |value: Value| {
            values.push(value);
            format!("${}", values.len())
        };
        if let Some(prefix) = &self.id_prefix {
            // Ids compare bytewise (PostgreSQL: COLLATE "C") and use only characters below
            // U+007F, so every id with the prefix is in [prefix, prefix + U+007F): a range the
            // primary key answers.
            let (low, high) = (mark(prefix.as_str().into()), mark(format!("{prefix}\u{7f}").into()));
            sql.push_str(&format!(" AND id >= {low} AND id < {high}"));
        }
        if let Some(owner) = &self.owner {
            sql.push_str(&format!(" AND owner = {}", mark(owner.as_str().into())));
        }
        if let Some(text) = &self.search {
            // The title's words, whatever their case (ASCII), with the text's `%`, `_` and `\`
            // taken as themselves; or the ids with the text as their prefix (the primary key's
            // range, as `id_prefix`). A scan of the rows that the other conditions leave.
            let escaped: String = text
                .to_ascii_lowercase()
                .chars()
                .flat_map(|c| if matches!(c, '%' | '_' | '\\') { vec!['\\', c] } else { vec![c] })
                .collect();
            let title = mark(format!("%{escaped}%").into());
            let (low, high) = (mark(text.as_str().into()), mark(format!("{text}\u{7f}").into()));
            sql.push_str(&format!(" AND (lower(title) LIKE {title} ESCAPE '\\' OR (id >= {low} AND id < {high}))"));
        }
        if !self.statuses.is_empty() {
            // Values are bound, only the placeholders are generated.
            let marks: Vec<String> = self.statuses.iter().map(|s| mark(s.as_str().into())).collect();
            sql.push_str(&format!(" AND status IN ({})", marks.join(", ")));
        }
        (sql, values)
    }
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
            last_reason: None,
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

    /// Newest activity first (then by id), a page of `limit` after `after`.
    pub async fn list_conversations(&self, f: &ConversationFilter) -> StoreResult<Vec<ConversationMeta>> {
        let (conditions, values) = f.conditions();
        let mut sql = format!("SELECT {META_COLUMNS} FROM conversations WHERE {conditions}");
        let n = values.len();
        if f.after.is_some() {
            // The rows after the page's last in the listing's order: `conversations_by_activity`.
            let (at, id) = (n + 1, n + 2);
            sql.push_str(&format!(" AND (last_activity_at < ${at} OR (last_activity_at = ${at} AND id > ${id}))"));
        }
        let limit = n + if f.after.is_some() { 3 } else { 1 };
        sql.push_str(&format!(" ORDER BY last_activity_at DESC, id LIMIT ${limit}"));
        let mut q = values.into_iter().fold(Query::new(sql), Query::bind);
        if let Some((at, id)) = &f.after {
            q = q.bind(*at).bind(id.as_str());
        }
        let rows: Vec<ConversationRow> = self.fetch_all(q.bind(i64::from(f.limit))).await?;
        rows.into_iter().map(meta).collect()
    }

    /// How many conversations the filter finds, on every page.
    pub async fn count_conversations(&self, f: &ConversationFilter) -> StoreResult<u64> {
        let (conditions, values) = f.conditions();
        let sql = format!("SELECT count(*) FROM conversations WHERE {conditions}");
        let q = values.into_iter().fold(Query::new(sql), Query::bind);
        let (n,): (i64,) = self.fetch_optional(q).await?.unwrap_or((0,));
        Ok(n.max(0) as u64)
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

    /// Pages follow each other by last activity then id, each conversation once, ties of
    /// activity included; a count reads every page; the last turn's end is listed, on both
    /// backends.
    #[tokio::test]
    async fn a_listing_reads_in_pages_with_a_count_and_each_last_turns_end() {
        for t in every_backend().await {
            let (store, b) = (&t.store, t.backend);
            // Two share a last activity: the id orders them.
            for (id, now) in [("p1", 10), ("p2", 20), ("p3", 20), ("p4", 30), ("p5", 40)] {
                let new = NewConversation { id, title: "", model: None, owner: None, now };
                store.create_conversation(new).await.unwrap();
            }
            let mut seen = Vec::new();
            let mut after = None;
            loop {
                let filter = ConversationFilter { id_prefix: Some("p".into()), after, limit: 2, ..Default::default() };
                let page = store.list_conversations(&filter).await.unwrap();
                assert_eq!(store.count_conversations(&filter).await.unwrap(), 5, "{b}");
                seen.extend(page.iter().map(|c| c.id.clone()));
                match page.last() {
                    Some(last) if page.len() == 2 => after = Some((last.last_activity_at, last.id.clone())),
                    _ => break,
                }
            }
            assert_eq!(seen, ["p5", "p4", "p2", "p3", "p1"], "{b}");

            // A sealed turn's reason is listed; none before a turn ended.
            let listed = |id: &'static str| async move {
                let filter = ConversationFilter { id_prefix: Some(id.into()), limit: 1, ..Default::default() };
                store.list_conversations(&filter).await.unwrap().remove(0).last_reason
            };
            assert_eq!(listed("p1").await, None, "{b}");
            store.begin_test_turn("p1", "t1").await;
            assert_eq!(listed("p1").await, None, "{b}: a running turn has not ended");
            store.seal_test_turn("p1", "t1", None, &[]).await.unwrap();
            assert_eq!(listed("p1").await.as_deref(), Some("stop"), "{b}");
            assert_eq!(store.conversation("p1").await.unwrap().unwrap().last_reason.as_deref(), Some("stop"), "{b}");
        }
    }
}
