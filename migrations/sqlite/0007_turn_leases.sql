-- A conversation's running turn holds its lease: the turn's id and when the lease ends unless
-- renewed. A turn's writes (appends, seal) name the turn and are refused once the lease is not
-- its own, so a gateway that lost a turn (its lease expired and another gateway marked the turn
-- interrupted) cannot write to the log again. Turns open when this column arrived hold none;
-- the next start marks them interrupted, as before.
ALTER TABLE conversations ADD COLUMN lease_turn TEXT;
ALTER TABLE conversations ADD COLUMN lease_expires_at INTEGER;
