-- When a conversation was deleted (see migrations/sqlite/0009): reads leave a marked
-- conversation out while its rows are removed in batches under the deletion's lease.
ALTER TABLE conversations ADD COLUMN deleted_at BIGINT;
-- Every gateway's lease sweep looks for deletions whose lease ended; only marked rows are in it.
CREATE INDEX conversations_deleted ON conversations (lease_expires_at) WHERE deleted_at IS NOT NULL;
