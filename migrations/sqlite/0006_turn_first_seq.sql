-- Where each turn begins in the log: the seq of its user message. A stream that replays a turn
-- from its start tells its client to read history only up to just before it, even when the turn
-- sealed (and moved the horizon past it) between the subscription and that read.
ALTER TABLE turns ADD COLUMN first_seq INTEGER;
UPDATE turns SET first_seq = (
    SELECT min(seq) FROM chunks WHERE chunks.conversation_id = turns.conversation_id AND chunks.turn_id = turns.turn_id
);
