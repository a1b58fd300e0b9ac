-- Credentials that can be taken back (see migrations/sqlite/0014).
CREATE TABLE api_keys (
    id TEXT COLLATE "C" PRIMARY KEY,
    name TEXT NOT NULL,
    hash TEXT COLLATE "C" NOT NULL UNIQUE,
    admin BIGINT NOT NULL,
    quotas TEXT,
    created_at BIGINT NOT NULL,
    expires_at BIGINT,
    last_used_at BIGINT
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
    hour BIGINT NOT NULL,
    tokens BIGINT NOT NULL,
    PRIMARY KEY (subject, hour)
);
CREATE TABLE quota_seconds (
    subject TEXT NOT NULL,
    second BIGINT NOT NULL,
    turns BIGINT NOT NULL,
    PRIMARY KEY (subject, second)
);
