-- The key gateways on a bus sign their messages with (src/bus/sign.rs): made by the first
-- gateway that joins, read by the others. One row. (A SQLite gateway has no bus; the table is
-- here so that both backends keep one schema.)
CREATE TABLE bus_secret (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    secret TEXT NOT NULL
);
