-- Pause: an operator (or a step whose retries are spent) stops one saga, or
-- every saga of a type, from starting new steps; what runs finishes.
--
-- A pause is a row here. While it exists, every pending step command of the
-- paused sagas (a row with a saga_id and a step_key: local commands, remote
-- commands not yet published, timers, wake-ups) is held: its available_at
-- is moved to 'infinity' and the time it was due is kept in paused_from, so
-- no claim, relay or timer sees it. Pausing holds the commands already
-- written; the trigger below holds the ones written while the pause lasts
-- (the next command of a step that was running, a signal's wake-up, a
-- concurrency slot's admission, a new saga of a paused type). Resuming
-- deletes the row and makes each held command due when it was due before
-- (at once when that time has passed). The rescuer leaves paused sagas
-- alone.
CREATE TABLE {{schema}}.saga_pauses (
    id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- 'saga': saga_id is paused; 'type': every saga named saga_name.
    kind      text        NOT NULL CHECK (kind IN ('saga', 'type')),
    saga_id   uuid,
    saga_name text        NOT NULL,
    -- 'operator', or 'retries_exhausted' for a step that asked to pause.
    code      text        NOT NULL,
    reason    text        NOT NULL,
    step_name text,
    paused_at timestamptz NOT NULL DEFAULT now(),
    CHECK ((kind = 'saga') = (saga_id IS NOT NULL))
);
CREATE UNIQUE INDEX saga_pauses_saga ON {{schema}}.saga_pauses (saga_id) WHERE kind = 'saga';
CREATE UNIQUE INDEX saga_pauses_type ON {{schema}}.saga_pauses (saga_name) WHERE kind = 'type';

ALTER TABLE {{schema}}.outbox ADD COLUMN paused_from timestamptz;

-- Holds a step command of a paused saga as it is written or made due. With
-- no pause at all (the usual case) it costs one probe of an empty table.
CREATE FUNCTION {{schema}}.saga_hold_paused() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'pending' AND NEW.available_at <> 'infinity' AND EXISTS (
        SELECT 1 FROM {{schema}}.saga_pauses p
        WHERE (p.kind = 'saga' AND p.saga_id = NEW.saga_id)
           OR (p.kind = 'type' AND 'saga.' || p.saga_name = NEW.aggregatetype)) THEN
        NEW.paused_from := NEW.available_at;
        NEW.available_at := 'infinity';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER saga_hold_paused
    BEFORE INSERT OR UPDATE OF available_at ON {{schema}}.outbox
    FOR EACH ROW
    WHEN (NEW.saga_id IS NOT NULL AND NEW.step_key IS NOT NULL)
    EXECUTE FUNCTION {{schema}}.saga_hold_paused();

-- Held commands, by saga, for resume.
CREATE INDEX outbox_paused ON {{schema}}.outbox (saga_id) WHERE paused_from IS NOT NULL;

-- A saga that ends (a step that ran while it was paused was its last, or
-- an operator ended it) is no longer paused.
CREATE FUNCTION {{schema}}.saga_end_pause() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM {{schema}}.saga_pauses WHERE kind = 'saga' AND saga_id = NEW.id;
    RETURN NULL;
END $$;

CREATE TRIGGER saga_end_pause
    AFTER UPDATE OF status ON {{schema}}.saga_instances
    FOR EACH ROW
    WHEN (NEW.status IN ('completed', 'compensated', 'failed') AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION {{schema}}.saga_end_pause();
