-- Concurrency keys: at most N running sagas per (saga name, key).
--
-- A saga started with a key either takes one of its key's slots (a row in
-- saga_concurrency_holders) or waits in saga_concurrency_queue, in start
-- order. A waiting saga is an ordinary 'running' saga at its first step
-- whose first command is held: its outbox row is due at 'infinity', so no
-- claim and no relay sees it, and it has no rescue deadline. Admitting it
-- makes that row due now.
--
-- Slots are released by a trigger in the transaction that ends the saga
-- (completed, compensated, failed), whatever wrote it: the executor, the
-- rescuer, a cancel, an operator. A crash therefore cannot leak or double
-- a slot: the release commits with the end, or neither does.
ALTER TABLE {{schema}}.saga_instances ADD COLUMN concurrency_key text;

-- One row per key in use: how many sagas hold a slot, and the definition's
-- limit as of the last start. Starters lock this row (the upsert), so the
-- check and the taking of a slot are one decision per key.
CREATE TABLE {{schema}}.saga_concurrency_keys (
    saga_name text    NOT NULL,
    ckey      text    NOT NULL,
    max_slots integer NOT NULL CHECK (max_slots > 0),
    running   integer NOT NULL DEFAULT 0 CHECK (running >= 0),
    PRIMARY KEY (saga_name, ckey)
);

-- The sagas holding a slot.
CREATE TABLE {{schema}}.saga_concurrency_holders (
    saga_id   uuid PRIMARY KEY,
    saga_name text NOT NULL,
    ckey      text NOT NULL
);

-- The sagas waiting for a slot, in start order (seq). check_us is the rescue
-- deadline, in microseconds, the saga gets once admitted.
CREATE TABLE {{schema}}.saga_concurrency_queue (
    seq        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    saga_id    uuid        NOT NULL UNIQUE,
    saga_name  text        NOT NULL,
    ckey       text        NOT NULL,
    command_id uuid        NOT NULL,
    check_us   bigint      NOT NULL,
    queued_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX saga_concurrency_queue_key ON {{schema}}.saga_concurrency_queue (saga_name, ckey, seq);
CREATE INDEX saga_instances_concurrency_key ON {{schema}}.saga_instances (saga_name, concurrency_key)
    WHERE concurrency_key IS NOT NULL;

-- A saga was just inserted, in this transaction, with a key: it takes a
-- slot when its key is under its limit and nobody waits, else it joins the
-- queue (its first command held, no rescue deadline). Returns its position,
-- 0 when admitted, or -1 when this transaction did not insert the saga (a
-- start that found an existing saga): then nothing is written. A raised
-- limit takes effect at the key's next release.
CREATE FUNCTION {{schema}}.saga_concurrency_admit(p_id uuid, p_name text, p_key text, p_max integer,
        p_command uuid, p_check_us bigint, OUT pos integer, OUT running integer)
LANGUAGE plpgsql AS $$
DECLARE
    k {{schema}}.saga_concurrency_keys%ROWTYPE;
BEGIN
    PERFORM 1 FROM {{schema}}.saga_instances s
        WHERE s.id = p_id AND s.concurrency_key IS NULL
          AND s.xmin::text = (pg_current_xact_id()::text::numeric % 4294967296)::text;
    IF NOT FOUND THEN
        pos := -1;
        running := 0;
        RETURN;
    END IF;
    INSERT INTO {{schema}}.saga_concurrency_keys AS c (saga_name, ckey, max_slots, running)
        VALUES (p_name, p_key, p_max, 0)
        ON CONFLICT (saga_name, ckey) DO UPDATE SET max_slots = EXCLUDED.max_slots
        RETURNING * INTO k;
    IF k.running < k.max_slots AND NOT EXISTS (SELECT 1 FROM {{schema}}.saga_concurrency_queue q
                                               WHERE q.saga_name = p_name AND q.ckey = p_key) THEN
        UPDATE {{schema}}.saga_concurrency_keys SET running = k.running + 1 WHERE saga_name = p_name AND ckey = p_key;
        INSERT INTO {{schema}}.saga_concurrency_holders (saga_id, saga_name, ckey) VALUES (p_id, p_name, p_key);
        UPDATE {{schema}}.saga_instances SET concurrency_key = p_key WHERE id = p_id;
        pos := 0;
        running := k.running + 1;
        RETURN;
    END IF;
    SELECT count(*) + 1 INTO pos FROM {{schema}}.saga_concurrency_queue q WHERE q.saga_name = p_name AND q.ckey = p_key;
    INSERT INTO {{schema}}.saga_concurrency_queue (saga_id, saga_name, ckey, command_id, check_us)
        VALUES (p_id, p_name, p_key, p_command, p_check_us);
    UPDATE {{schema}}.outbox SET available_at = 'infinity' WHERE id = p_command;
    UPDATE {{schema}}.saga_instances SET concurrency_key = p_key, next_check_at = NULL WHERE id = p_id;
    INSERT INTO {{schema}}.saga_history (saga_id, event, step_name, direction, epoch, attempt, detail)
        SELECT p_id, 'concurrency_queued', s.step_name, s.direction, s.epoch, 0,
               jsonb_build_object('concurrency_key', p_key, 'position', pos, 'running', k.running, 'limit', k.max_slots)
        FROM {{schema}}.saga_instances s WHERE s.id = p_id;
    running := k.running;
END
$$;

-- A slot is given back: the saga that held it no longer does (it ended, or
-- was deleted while running). The next waiting sagas of the key are admitted
-- while the key is under its limit; a saga that was still waiting only
-- leaves the queue, and its held command goes with it.
CREATE FUNCTION {{schema}}.saga_concurrency_release(p_id uuid, p_name text, p_key text, p_channel text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    k   {{schema}}.saga_concurrency_keys%ROWTYPE;
    q   {{schema}}.saga_concurrency_queue%ROWTYPE;
    cmd uuid;
    top text;
BEGIN
    DELETE FROM {{schema}}.saga_concurrency_queue WHERE saga_id = p_id RETURNING command_id INTO cmd;
    IF FOUND THEN
        DELETE FROM {{schema}}.outbox WHERE id = cmd AND status = 'pending' AND available_at = 'infinity';
        RETURN;
    END IF;
    DELETE FROM {{schema}}.saga_concurrency_holders WHERE saga_id = p_id;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    SELECT * INTO k FROM {{schema}}.saga_concurrency_keys
        WHERE saga_name = p_name AND ckey = p_key FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    k.running := k.running - 1;
    WHILE k.running < k.max_slots LOOP
        DELETE FROM {{schema}}.saga_concurrency_queue
            WHERE seq = (SELECT seq FROM {{schema}}.saga_concurrency_queue
                         WHERE saga_name = p_name AND ckey = p_key ORDER BY seq LIMIT 1)
            RETURNING * INTO q;
        EXIT WHEN NOT FOUND;
        INSERT INTO {{schema}}.saga_concurrency_holders (saga_id, saga_name, ckey) VALUES (q.saga_id, p_name, p_key);
        k.running := k.running + 1;
        UPDATE {{schema}}.outbox SET available_at = clock_timestamp(), created_at = clock_timestamp()
            WHERE id = q.command_id AND status = 'pending' RETURNING topic INTO top;
        UPDATE {{schema}}.saga_instances SET next_check_at = clock_timestamp() + q.check_us * interval '1 microsecond'
            WHERE id = q.saga_id AND status IN ('running', 'compensating');
        INSERT INTO {{schema}}.saga_history (saga_id, event, step_name, direction, epoch, attempt, detail)
            SELECT q.saga_id, 'concurrency_admitted', s.step_name, s.direction, s.epoch, 0,
                   jsonb_build_object('concurrency_key', p_key)
            FROM {{schema}}.saga_instances s WHERE s.id = q.saga_id;
        IF top IS NOT NULL THEN
            PERFORM pg_notify(p_channel, top);
        END IF;
    END LOOP;
    UPDATE {{schema}}.saga_concurrency_keys SET running = k.running
        WHERE saga_name = p_name AND ckey = p_key;
END
$$;

-- A saga with a key changes status or is deleted: ending (or being deleted
-- before its end) releases its slot or its place; coming back from an end
-- (an operator's resume or rerun of a failed saga) takes a slot again at
-- once, even above the limit: the operator's act goes ahead of the queue,
-- and the queue waits until the key is under its limit again.
CREATE FUNCTION {{schema}}.saga_concurrency_trigger() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        PERFORM {{schema}}.saga_concurrency_release(OLD.id, OLD.saga_name, OLD.concurrency_key, TG_TABLE_SCHEMA || '_sagaflow');
        RETURN NULL;
    END IF;
    IF NEW.status IN ('completed', 'compensated', 'failed') THEN
        PERFORM {{schema}}.saga_concurrency_release(NEW.id, NEW.saga_name, NEW.concurrency_key, TG_TABLE_SCHEMA || '_sagaflow');
    ELSE
        INSERT INTO {{schema}}.saga_concurrency_holders (saga_id, saga_name, ckey)
            VALUES (NEW.id, NEW.saga_name, NEW.concurrency_key) ON CONFLICT DO NOTHING;
        IF FOUND THEN
            INSERT INTO {{schema}}.saga_concurrency_keys AS k (saga_name, ckey, max_slots, running)
                VALUES (NEW.saga_name, NEW.concurrency_key, 1, 1)
                ON CONFLICT (saga_name, ckey) DO UPDATE SET running = k.running + 1;
        END IF;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER saga_concurrency_end AFTER UPDATE OF status ON {{schema}}.saga_instances
    FOR EACH ROW
    WHEN (NEW.concurrency_key IS NOT NULL
          AND (NEW.status IN ('completed', 'compensated', 'failed')) <> (OLD.status IN ('completed', 'compensated', 'failed')))
    EXECUTE FUNCTION {{schema}}.saga_concurrency_trigger();
CREATE TRIGGER saga_concurrency_delete AFTER DELETE ON {{schema}}.saga_instances
    FOR EACH ROW
    WHEN (OLD.concurrency_key IS NOT NULL AND OLD.status IN ('running', 'compensating'))
    EXECUTE FUNCTION {{schema}}.saga_concurrency_trigger();
