-- When a conversation was deleted (see migrations/sqlite/0009): reads leave a marked
-- conversation out while its rows are removed in batches under the deletion's lease.
ALTER TABLE conversations ADD COLUMN deleted_at BIGINT;
