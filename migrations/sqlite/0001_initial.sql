-- Conversations, their append-only chunk log, and one row per turn.

CREATE TABLE conversations (
    id               TEXT    PRIMARY KEY NOT NULL,
    title            TEXT    NOT NULL DEFAULT '',
    status           TEXT    NOT NULL DEFAULT 'idle' CHECK (status IN ('active', 'idle', 'closed')),
    model            TEXT,
    created_at       INTEGER NOT NULL,
    last_activity_at INTEGER NOT NULL,
    -- Highest seq and message id handed out; bumped inside the inserting transaction.
    last_seq         INTEGER NOT NULL DEFAULT 0,
    last_message_id  INTEGER NOT NULL DEFAULT 0,
    -- How many turns were ever started here: gives each turn its ordinal.
    turn_count       INTEGER NOT NULL DEFAULT 0,
    -- A runtime's native session id, resumed by the next turn.
    session_id       TEXT
) WITHOUT ROWID;

CREATE INDEX conversations_by_activity ON conversations (last_activity_at DESC, id);

CREATE TABLE chunks (
    conversation_id TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    seq             INTEGER NOT NULL,
    message_id      INTEGER NOT NULL,
    turn_id         TEXT    NOT NULL,
    role            TEXT    NOT NULL,
    chunk           TEXT    NOT NULL,
    PRIMARY KEY (conversation_id, seq)
) WITHOUT ROWID;

CREATE TABLE turns (
    conversation_id TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    turn_id         TEXT    NOT NULL,
    ordinal         INTEGER NOT NULL,
    model           TEXT    NOT NULL,
    started_at      INTEGER NOT NULL,
    -- Set together when the turn seals: its TurnMetrics as JSON and the figures throughput needs.
    sealed_at       INTEGER,
    reason          TEXT,
    metrics         TEXT,
    output_tokens   INTEGER,
    gen_total_ms    INTEGER,
    -- Set when a restart found the turn cut off and appended its `interrupted` error chunk.
    interrupted_at  INTEGER,
    PRIMARY KEY (conversation_id, turn_id)
) WITHOUT ROWID;

CREATE UNIQUE INDEX turns_by_ordinal ON turns (conversation_id, ordinal);
CREATE INDEX turns_open ON turns (sealed_at, interrupted_at) WHERE sealed_at IS NULL AND interrupted_at IS NULL;
CREATE INDEX turns_by_sealed_at ON turns (sealed_at) WHERE sealed_at IS NOT NULL;
