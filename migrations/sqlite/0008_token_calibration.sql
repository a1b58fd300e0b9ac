-- How many tokens the upstream counted per estimated token in the conversation's last counted
-- request (the `openai` runtime's calibration of its context trimming; NULL until one).
ALTER TABLE conversations ADD COLUMN tokens_per_estimate REAL;
