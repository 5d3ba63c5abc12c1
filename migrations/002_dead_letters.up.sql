-- Messages a consumer could not process: undecodable, of an unknown type,
-- oversized, or refused for good by their handler. Kept with the reason and
-- the original bytes, for an operator; never deleted by retention.
CREATE TABLE {{schema}}.dead_letters (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer    text        NOT NULL,
    message_id  text,
    topic       text        NOT NULL DEFAULT '',
    kafka_partition integer,
    kafka_offset    bigint,
    msg_key     bytea,
    msg_value   bytea,
    headers     jsonb       NOT NULL DEFAULT '{}',
    reason      text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX dead_letters_consumer ON {{schema}}.dead_letters (consumer, created_at);
