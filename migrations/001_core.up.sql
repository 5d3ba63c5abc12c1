-- sagaflow core tables. {{schema}} is replaced by the quoted target schema.

CREATE TABLE {{schema}}.saga_instances (
    id              uuid        PRIMARY KEY,
    saga_name       text        NOT NULL,
    business_key    text,
    status          text        NOT NULL
        CHECK (status IN ('running', 'compensating', 'completed', 'compensated', 'failed')),
    step_index      integer     NOT NULL,
    step_name       text        NOT NULL,
    direction       text        NOT NULL CHECK (direction IN ('forward', 'compensate')),
    epoch           integer     NOT NULL DEFAULT 0,
    attempt         integer     NOT NULL DEFAULT 0,
    state           jsonb       NOT NULL,
    version         bigint      NOT NULL DEFAULT 1,
    next_check_at   timestamptz,
    -- The outbox id of the command for the current version, so the rescuer
    -- can tell a saga waiting in the queue from one whose command was lost.
    command_id      uuid,
    last_error      text,
    last_error_code text,
    failed_step     text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    ended_at        timestamptz,
    CONSTRAINT saga_instances_business_key UNIQUE (saga_name, business_key)
) WITH (fillfactor = 80);

-- The rescuer's scan: non-terminal sagas ordered by their deadline.
CREATE INDEX saga_instances_next_check ON {{schema}}.saga_instances (next_check_at)
    WHERE status IN ('running', 'compensating');
-- Listing, newest first, by name or by status.
CREATE INDEX saga_instances_name_created ON {{schema}}.saga_instances (saga_name, created_at DESC, id DESC);
CREATE INDEX saga_instances_status_created ON {{schema}}.saga_instances (status, created_at DESC, id DESC);
CREATE INDEX saga_instances_created ON {{schema}}.saga_instances (created_at DESC, id DESC);
-- Retention of finished sagas, oldest first.
CREATE INDEX saga_instances_ended ON {{schema}}.saga_instances (ended_at)
    WHERE status IN ('completed', 'compensated');

CREATE TABLE {{schema}}.saga_history (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    saga_id     uuid        NOT NULL,
    event       text        NOT NULL,
    step_name   text,
    direction   text,
    epoch       integer,
    attempt     integer,
    error       text,
    error_code  text,
    detail      jsonb,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX saga_history_saga ON {{schema}}.saga_history (saga_id, id);

-- The outbox. Column names aggregatetype, aggregateid, type and payload follow
-- Debezium's outbox event router, so a CDC pipeline can replace the relay
-- (route by the topic column).
CREATE TABLE {{schema}}.outbox (
    id            uuid        PRIMARY KEY,
    topic         text        NOT NULL,
    delivery      text        NOT NULL DEFAULT 'relay' CHECK (delivery IN ('relay', 'direct')),
    aggregatetype text        NOT NULL DEFAULT '',
    aggregateid   text        NOT NULL,
    type          text        NOT NULL,
    payload       bytea       NOT NULL,
    headers       jsonb       NOT NULL DEFAULT '{}',
    saga_id       uuid,
    step_key      text,
    status        text        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'published', 'dead')),
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text,
    available_at  timestamptz NOT NULL DEFAULT now(),
    created_at    timestamptz NOT NULL DEFAULT now(),
    published_at  timestamptz
) WITH (
    fillfactor = 80,
    -- A queue table: rows are inserted and consumed all day. Vacuum it after
    -- a fixed number of dead rows, not a fraction of its size, so that
    -- claims do not wade through dead index entries.
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000
);

-- Engine workers claim direct commands per topic and delete them once
-- consumed (the saga history records them); the relay claims the rest.
CREATE INDEX outbox_direct_pending ON {{schema}}.outbox (topic, available_at)
    WHERE status = 'pending' AND delivery = 'direct';
-- (available_at, id): the relay claims in that order, and a backlog written
-- by one transaction shares one available_at; without id in the index every
-- claim would sort the whole backlog.
CREATE INDEX outbox_relay_pending ON {{schema}}.outbox (available_at, id)
    WHERE status = 'pending' AND delivery = 'relay';
CREATE INDEX outbox_dead ON {{schema}}.outbox (created_at) WHERE status = 'dead';
-- Retention and replay of published messages.
CREATE INDEX outbox_published ON {{schema}}.outbox (published_at) WHERE status = 'published';

-- Processed message and step keys, per consumer. A key is written in the same
-- transaction as the effects it guards.
CREATE TABLE {{schema}}.inbox (
    consumer     text        NOT NULL,
    key          text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, key)
);
CREATE INDEX inbox_processed_at ON {{schema}}.inbox (processed_at);
