-- When a conversation was deleted. A deletion marks the row and holds its lease (as a turn
-- would, so no turn opens), then removes its rows in batches and the row last: reads leave a
-- marked conversation out, and a deletion cut off is finished by whichever gateway finds its
-- lease ended.
ALTER TABLE conversations ADD COLUMN deleted_at INTEGER;
-- Every gateway's lease sweep looks for deletions whose lease ended; only marked rows are in it.
CREATE INDEX conversations_deleted ON conversations (lease_expires_at) WHERE deleted_at IS NOT NULL;
