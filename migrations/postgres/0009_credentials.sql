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
