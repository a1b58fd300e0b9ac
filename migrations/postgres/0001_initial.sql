-- The schema of migrations/sqlite as one PostgreSQL migration: conversations, their
-- append-only chunk log, one row per turn, idempotency keys.
--
-- Ids and keys compare byte by byte (COLLATE "C"), as SQLite compares text: listing by id
-- prefix is a range of the primary key, and orders do not depend on the server's locale.
-- Chunks are kept as the exact JSON text written (TEXT, not jsonb, which would reorder keys):
-- history windows pass it through unparsed, so the CHECK refuses text that is not JSON.

CREATE TABLE conversations (
    id               TEXT COLLATE "C" PRIMARY KEY,
    title            TEXT   NOT NULL DEFAULT '',
    status           TEXT   NOT NULL DEFAULT 'idle' CHECK (status IN ('active', 'idle', 'closed')),
    model            TEXT,
    created_at       BIGINT NOT NULL,
    last_activity_at BIGINT NOT NULL,
    -- Highest seq and message id handed out; bumped inside the inserting transaction, whose row
    -- lock orders writers of the same conversation on every node.
    last_seq         BIGINT NOT NULL DEFAULT 0,
    last_message_id  BIGINT NOT NULL DEFAULT 0,
    -- How many turns were ever started here: gives each turn its ordinal.
    turn_count       BIGINT NOT NULL DEFAULT 0,
    -- A runtime's native session id, resumed by the next turn.
    session_id       TEXT,
    -- The history horizon: the highest seq of the sealed turns (see sqlite/0004).
    sealed_seq       BIGINT NOT NULL DEFAULT 0,
    cwd              TEXT,
    reasoning_effort TEXT
);

CREATE INDEX conversations_by_activity ON conversations (last_activity_at DESC, id);

CREATE TABLE chunks (
    conversation_id TEXT COLLATE "C" NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    seq             BIGINT NOT NULL,
    message_id      BIGINT NOT NULL,
    turn_id         TEXT   NOT NULL,
    role            TEXT   NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
    chunk           TEXT   NOT NULL CHECK (chunk::json IS NOT NULL),
    PRIMARY KEY (conversation_id, seq)
);

CREATE TABLE turns (
    conversation_id TEXT COLLATE "C" NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    turn_id         TEXT COLLATE "C" NOT NULL,
    ordinal         BIGINT NOT NULL,
    model           TEXT   NOT NULL,
    started_at      BIGINT NOT NULL,
    -- The seq of the turn's user message (see sqlite/0006).
    first_seq       BIGINT,
    -- Set together when the turn seals: its TurnMetrics as JSON and the figures throughput needs.
    sealed_at       BIGINT,
    reason          TEXT,
    metrics         TEXT,
    output_tokens   BIGINT,
    gen_total_ms    BIGINT,
    -- Set when the turn was found cut off and its `interrupted` error chunk appended.
    interrupted_at  BIGINT,
    PRIMARY KEY (conversation_id, turn_id)
);

CREATE UNIQUE INDEX turns_by_ordinal ON turns (conversation_id, ordinal);
CREATE INDEX turns_open ON turns (conversation_id) WHERE sealed_at IS NULL AND interrupted_at IS NULL;
CREATE INDEX turns_by_sealed_at ON turns (sealed_at) WHERE sealed_at IS NOT NULL;

-- Idempotency keys of POST /conversations/:id/messages, kept at least 24 hours.
CREATE TABLE idempotency_keys (
    conversation_id TEXT COLLATE "C" NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    key             TEXT COLLATE "C" NOT NULL,
    body_hash       TEXT   NOT NULL,
    response        TEXT   NOT NULL,
    created_at      BIGINT NOT NULL,
    PRIMARY KEY (conversation_id, key)
);

CREATE INDEX idempotency_keys_by_age ON idempotency_keys (created_at);
