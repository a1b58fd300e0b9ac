-- The model (`credential/model`) whose request `tokens_per_estimate` was measured on: a turn on
-- another model starts from no calibration rather than another tokenizer's (NULL: none yet, or
-- measured before this column existed).
ALTER TABLE conversations ADD COLUMN calibrated_model TEXT;
