-- A sealed turn's time to first token (see sqlite/0013).
ALTER TABLE turns ADD COLUMN ttft_ms BIGINT;
UPDATE turns SET ttft_ms = (metrics::json #>> '{steps,0,ttftMs}')::bigint WHERE metrics IS NOT NULL;
