-- Idempotency keys of POST /conversations/:id/messages, kept at least 24 hours.

CREATE TABLE idempotency_keys (
    conversation_id TEXT    NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    key             TEXT    NOT NULL,
    -- A hash of the request body: the same key with another body is a conflict.
    body_hash       TEXT    NOT NULL,
    -- The JSON of the first answer, returned again for a repeated request.
    response        TEXT    NOT NULL,
    created_at      INTEGER NOT NULL,
    PRIMARY KEY (conversation_id, key)
) WITHOUT ROWID;

CREATE INDEX idempotency_keys_by_age ON idempotency_keys (created_at);
