-- Identities (spec 8.3 to 8.5). A conversation's owner is the subject that created it; rows
-- from before (and from a gateway with auth off) have none, and only administrators see them.
ALTER TABLE conversations ADD COLUMN owner TEXT;
-- A user's list: their own conversations, newest activity first.
CREATE INDEX conversations_by_owner ON conversations (owner, last_activity_at DESC, id);
-- Browser sessions: the cookie's value is never stored, only its SHA-256.
CREATE TABLE sessions (
    id_hash TEXT PRIMARY KEY,
    subject TEXT NOT NULL,
    admin INTEGER NOT NULL,
    expires_at INTEGER NOT NULL
);
CREATE INDEX sessions_by_expiry ON sessions (expires_at);
-- Quotas: each turn a subject started, with the tokens it used once sealed (turns per
-- minute, tokens per day). Kept apart from `turns` so that deleting a conversation does not
-- give its budget back; rows older than a day are removed as new ones come.
CREATE TABLE quota_turns (
    subject TEXT NOT NULL,
    turn_id TEXT NOT NULL,
    started_at INTEGER NOT NULL,
    tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (subject, turn_id)
);
CREATE INDEX quota_turns_by_time ON quota_turns (subject, started_at);
-- Quotas: the streams each gateway has open per subject, refreshed while open; a row whose
-- gateway stopped refreshing it (a crash) stops counting.
CREATE TABLE quota_streams (
    gateway TEXT NOT NULL,
    subject TEXT NOT NULL,
    open INTEGER NOT NULL,
    seen_at INTEGER NOT NULL,
    PRIMARY KEY (gateway, subject)
);
