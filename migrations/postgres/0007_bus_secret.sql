-- The key gateways on a bus sign their messages with (src/bus/sign.rs): made by the first
-- gateway that joins, read by the others. One row.
CREATE TABLE bus_secret (
    id BIGINT PRIMARY KEY CHECK (id = 1),
    secret TEXT NOT NULL
);
