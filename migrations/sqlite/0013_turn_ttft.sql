-- A sealed turn's time to first token (its first step's `ttftMs`), kept beside its output
-- tokens and generation time for `GET /metrics/series`: figures over time are read from these
-- columns, never by parsing each turn's metrics. Turns sealed before the column are filled from
-- their metrics here.
ALTER TABLE turns ADD COLUMN ttft_ms INTEGER;
UPDATE turns SET ttft_ms = json_extract(metrics, '$.steps[0].ttftMs') WHERE metrics IS NOT NULL;
