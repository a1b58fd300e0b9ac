-- The history horizon: the highest seq of the conversation's sealed turns. History reads show
-- chunks up to it (the in-flight turn is the live replay's, never both), and it moves in the
-- transaction that seals a turn, or that marks a cut one interrupted. What was in the log when
-- this column arrived is shown as it was; a turn cut by a crash is marked at the next start.
ALTER TABLE conversations ADD COLUMN sealed_seq INTEGER NOT NULL DEFAULT 0;
UPDATE conversations SET sealed_seq = last_seq;
