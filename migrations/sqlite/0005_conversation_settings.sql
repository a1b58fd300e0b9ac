-- Per-conversation settings a turn falls back to when its request names none (the reference
-- web client's side panels): the working directory and the reasoning effort.
ALTER TABLE conversations ADD COLUMN cwd TEXT;
ALTER TABLE conversations ADD COLUMN reasoning_effort TEXT;
