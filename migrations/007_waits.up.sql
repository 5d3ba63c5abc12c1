-- Sagas that wait: durable timers, signals, child sagas and deadlines.
--
-- A saga waiting at a step records what it waits for (wait_kind, wait_for)
-- and until when (wait_until, in database time; NULL waits without a time
-- limit). The command that ends a timed wait is an ordinary outbox row due
-- at wait_until, found by the claim's index like any other due command, so
-- a sleeping saga costs nothing until then.
ALTER TABLE {{schema}}.saga_instances
    ADD COLUMN wait_kind   text CHECK (wait_kind IN ('timer', 'signal', 'child')),
    ADD COLUMN wait_for    text,
    ADD COLUMN wait_until  timestamptz,
    -- The whole saga must end by then, or it compensates.
    ADD COLUMN deadline_at timestamptz,
    -- A child saga: the saga that started it, its name, and the key of the
    -- step that waits for it.
    ADD COLUMN parent_id   uuid,
    ADD COLUMN parent_name text,
    ADD COLUMN parent_key  text;

CREATE INDEX saga_instances_deadline ON {{schema}}.saga_instances (deadline_at)
    WHERE status = 'running' AND deadline_at IS NOT NULL;
CREATE INDEX saga_instances_waiting ON {{schema}}.saga_instances (created_at DESC, id DESC)
    WHERE wait_kind IS NOT NULL;
CREATE INDEX saga_instances_parent ON {{schema}}.saga_instances (parent_id)
    WHERE parent_id IS NOT NULL;

-- A cancel request made by the engine itself (a passed deadline) carries
-- its own error code; an operator's has none and records 'cancelled'.
ALTER TABLE {{schema}}.saga_cancel_requests ADD COLUMN code text;

-- Signals sent to sagas. A signal is kept until a step awaits it, and
-- delivered in the order signals of its name arrived. signal_id
-- deduplicates per saga (per address, when no saga matched). A signal
-- that no saga can take (the saga ended, or does not exist) is kept as
-- rejected, with the reason.
CREATE TABLE {{schema}}.saga_signals (
    seq          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    saga_id      uuid,
    target       text        NOT NULL,
    name         text        NOT NULL,
    signal_id    text        NOT NULL,
    payload      bytea       NOT NULL,
    status       text        NOT NULL CHECK (status IN ('pending', 'delivered', 'rejected')),
    error        text,
    step_name    text,
    epoch        integer,
    created_at   timestamptz NOT NULL DEFAULT now(),
    delivered_at timestamptz
);
CREATE UNIQUE INDEX saga_signals_dedupe ON {{schema}}.saga_signals ((coalesce(saga_id::text, target)), signal_id);
CREATE INDEX saga_signals_pending ON {{schema}}.saga_signals (saga_id, name, seq) WHERE status = 'pending';
CREATE INDEX saga_signals_saga ON {{schema}}.saga_signals (saga_id, seq);
-- Signals that matched no saga are deleted after the saga retention.
CREATE INDEX saga_signals_orphan ON {{schema}}.saga_signals (created_at) WHERE saga_id IS NULL;
