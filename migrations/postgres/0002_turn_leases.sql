-- A conversation's running turn holds its lease (see migrations/sqlite/0007): the turn's id,
-- and when the lease ends unless the gateway running the turn renews it. Expired leases are
-- found by every gateway's sweeper; one of them marks the turn interrupted.
ALTER TABLE conversations ADD COLUMN lease_turn TEXT COLLATE "C";
ALTER TABLE conversations ADD COLUMN lease_expires_at BIGINT;
CREATE INDEX conversations_leased ON conversations (lease_expires_at) WHERE lease_turn IS NOT NULL;
