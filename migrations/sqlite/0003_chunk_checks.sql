-- Every stored chunk is JSON and every role one of the log's four, checked when a row is
-- written (by any connection, the gateway's or a tool's): a history window is assembled from
-- the stored text as it lies, so a row that could break the window's JSON is never stored.
-- (A CHECK constraint would need the table rebuilt; triggers apply to existing databases.)

CREATE TRIGGER chunks_checked_insert BEFORE INSERT ON chunks
WHEN NOT json_valid(NEW.chunk) OR NEW.role NOT IN ('system', 'user', 'assistant', 'tool')
BEGIN
    SELECT RAISE(ABORT, 'a chunk must be JSON with a role of system, user, assistant or tool');
END;

CREATE TRIGGER chunks_checked_update BEFORE UPDATE OF chunk, role ON chunks
WHEN NOT json_valid(NEW.chunk) OR NEW.role NOT IN ('system', 'user', 'assistant', 'tool')
BEGIN
    SELECT RAISE(ABORT, 'a chunk must be JSON with a role of system, user, assistant or tool');
END;
