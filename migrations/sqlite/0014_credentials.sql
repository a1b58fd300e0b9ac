-- Credentials that can be taken back (docs/identity.md). Keys made at runtime: the secret is
-- never stored, only its SHA-256; the subject of a key is `key:<id>`; `quotas` (JSON) replace
-- `[quotas]` for it when set. Revoking a key removes its row and its sessions.
CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    hash TEXT NOT NULL UNIQUE,
    admin INTEGER NOT NULL,
    quotas TEXT,
    created_at INTEGER NOT NULL,
    expires_at INTEGER,
    last_used_at INTEGER
);
-- A session remembers the credential that made it (`key:<id>`, `api-key:<hash prefix>`,
-- `token:<kid>`), and the quotas it had (a made key's): taking the credential back ends it.
ALTER TABLE sessions ADD COLUMN credential TEXT NOT NULL DEFAULT '';
ALTER TABLE sessions ADD COLUMN quotas TEXT;
CREATE INDEX sessions_by_subject ON sessions (subject);
CREATE INDEX sessions_by_credential ON sessions (credential);
-- Quotas counted in bounded reads, whatever the rate: a subject's running turns by a partial
-- index (only the leased conversations), turns per minute from totals per second (at most 61
-- rows), tokens per day from totals per hour charged at each turn's seal (at most 25 rows).
-- They replace the row per turn of `quota_turns`, whose count grew with the rate.
DROP TABLE quota_turns;
CREATE INDEX conversations_leased_by_owner ON conversations (owner) WHERE lease_turn IS NOT NULL;
CREATE TABLE quota_tokens (
    subject TEXT NOT NULL,
    hour INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    PRIMARY KEY (subject, hour)
);
CREATE TABLE quota_seconds (
    subject TEXT NOT NULL,
    second INTEGER NOT NULL,
    turns INTEGER NOT NULL,
    PRIMARY KEY (subject, second)
);
