-- Identities (see migrations/sqlite/0011): owners, browser sessions, quota counts.
ALTER TABLE conversations ADD COLUMN owner TEXT;
-- A user's list: their own conversations, newest activity first.
CREATE INDEX conversations_by_owner ON conversations (owner, last_activity_at DESC, id);
-- Browser sessions: the cookie's value is never stored, only its SHA-256.
CREATE TABLE sessions (
    id_hash TEXT COLLATE "C" PRIMARY KEY,
    subject TEXT NOT NULL,
    admin BIGINT NOT NULL,
    expires_at BIGINT NOT NULL
);
CREATE INDEX sessions_by_expiry ON sessions (expires_at);
-- Quotas: each turn a subject started, with the tokens it used once sealed (turns per
-- minute, tokens per day). Kept apart from `turns` so that deleting a conversation does not
-- give its budget back; rows older than a day are removed as new ones come.
CREATE TABLE quota_turns (
    subject TEXT NOT NULL,
    turn_id TEXT NOT NULL,
    started_at BIGINT NOT NULL,
    tokens BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (subject, turn_id)
);
CREATE INDEX quota_turns_by_time ON quota_turns (subject, started_at);
-- Quotas: the streams each gateway has open per subject, refreshed while open; a row whose
-- gateway stopped refreshing it (a crash) stops counting.
CREATE TABLE quota_streams (
    gateway TEXT NOT NULL,
    subject TEXT NOT NULL,
    open BIGINT NOT NULL,
    seen_at BIGINT NOT NULL,
    PRIMARY KEY (gateway, subject)
);
