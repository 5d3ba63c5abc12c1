-- Concurrency keys: at most N running sagas per (saga name, key).
--
-- A saga started with a key either takes one of its key's slots (its key's
-- counter goes up) or waits in saga_concurrency_queue, in start order. A
-- waiting saga is an ordinary 'running' saga at its first step whose first
-- command is held: its outbox row is due at 'infinity', so no claim and no
-- relay sees it, and it has no rescue deadline. Admitting it makes that row
-- due now. A keyed saga that has not ended therefore either holds a slot or
-- waits, never both.
--
-- Slots are released by a trigger in the transaction that ends the saga
-- (completed, compensated, failed), whatever wrote it: the executor, the
-- rescuer, a cancel, an operator. A crash therefore cannot leak or double
-- a slot: the release commits with the end, or neither does.
ALTER TABLE {{schema}}.saga_instances ADD COLUMN concurrency_key text;
-- The key is written with the saga's row. It has no index: listing by key
-- narrows by name or status first.

-- One row per key in use: how many sagas hold a slot, and the definition's
-- limit as of the last start. Starters and releases lock this row, so each
-- decision to admit or queue is the only one for its key at a time. A key's
-- row is deleted when its last saga ends and nobody waits, so the table
-- holds only the keys in use. CHECK (running >= 0) turns a release that was
-- not owed into an error instead of a slot too many.
CREATE TABLE {{schema}}.saga_concurrency_keys (
    saga_name text    NOT NULL,
    ckey      text    NOT NULL,
    max_slots integer NOT NULL CHECK (max_slots > 0),
    running   integer NOT NULL CHECK (running >= 0),
    PRIMARY KEY (saga_name, ckey)
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
    k_max     integer;
    k_running integer;
    fresh     boolean;
BEGIN
    -- Inserted, with its key, by this transaction: created_at defaults to
    -- now(), the transaction's start, also when the insert ran in a
    -- savepoint (whose xmin would not be the transaction's id). The engine
    -- calls this once per start, right after the insert.
    PERFORM 1 FROM {{schema}}.saga_instances s
        WHERE s.id = p_id AND s.concurrency_key = p_key AND s.created_at = now();
    IF NOT FOUND THEN
        pos := -1;
        running := 0;
        RETURN;
    END IF;
    -- A key not in use yet: its row is made with this saga's slot taken.
    INSERT INTO {{schema}}.saga_concurrency_keys AS c (saga_name, ckey, max_slots, running)
        VALUES (p_name, p_key, p_max, 1)
        ON CONFLICT (saga_name, ckey) DO UPDATE SET max_slots = EXCLUDED.max_slots
        RETURNING c.max_slots, c.running, c.xmax = 0 INTO k_max, k_running, fresh;
    IF NOT fresh AND k_running < k_max AND NOT EXISTS (SELECT 1 FROM {{schema}}.saga_concurrency_queue q
                                                       WHERE q.saga_name = p_name AND q.ckey = p_key) THEN
        k_running := k_running + 1;
        UPDATE {{schema}}.saga_concurrency_keys SET running = k_running WHERE saga_name = p_name AND ckey = p_key;
        fresh := true;
    END IF;
    IF fresh THEN
        pos := 0;
        running := k_running;
        RETURN;
    END IF;
    SELECT count(*) + 1 INTO pos FROM {{schema}}.saga_concurrency_queue q WHERE q.saga_name = p_name AND q.ckey = p_key;
    INSERT INTO {{schema}}.saga_concurrency_queue (saga_id, saga_name, ckey, command_id, check_us)
        VALUES (p_id, p_name, p_key, p_command, p_check_us);
    UPDATE {{schema}}.outbox SET available_at = 'infinity' WHERE id = p_command;
    UPDATE {{schema}}.saga_instances SET next_check_at = NULL WHERE id = p_id;
    INSERT INTO {{schema}}.saga_history (saga_id, event, step_name, direction, epoch, attempt, detail)
        SELECT p_id, 'concurrency_queued', s.step_name, s.direction, s.epoch, 0,
               jsonb_build_object('concurrency_key', p_key, 'position', pos, 'running', k_running, 'limit', k_max)
        FROM {{schema}}.saga_instances s WHERE s.id = p_id;
    running := k_running;
END
$$;

-- A keyed saga ends (or is deleted before its end), or comes back from an
-- end. Ending: a waiting saga only leaves the queue, and its held command
-- goes with it; a saga holding a slot gives it back, and the next waiting
-- sagas of the key are admitted while the key is under its limit. Coming
-- back (an operator's resume or rerun of a failed saga) takes a slot again
-- at once, even above the limit: the operator's act goes ahead of the
-- queue, and the queue waits until the key is under its limit again.
CREATE FUNCTION {{schema}}.saga_concurrency_trigger() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    s         {{schema}}.saga_instances%ROWTYPE;
    q         {{schema}}.saga_concurrency_queue%ROWTYPE;
    k_max     integer;
    k_running integer;
    top       text;
BEGIN
    IF TG_OP = 'DELETE' THEN
        s := OLD;
    ELSE
        s := NEW;
    END IF;
    IF TG_OP = 'UPDATE' AND s.status IN ('running', 'compensating') THEN
        INSERT INTO {{schema}}.saga_concurrency_keys AS c (saga_name, ckey, max_slots, running)
            VALUES (s.saga_name, s.concurrency_key, 1, 1)
            ON CONFLICT (saga_name, ckey) DO UPDATE SET running = c.running + 1;
        RETURN NULL;
    END IF;
    -- The usual end, in one statement: the key's last saga, nobody
    -- waiting (so this saga does not wait either).
    DELETE FROM {{schema}}.saga_concurrency_keys c
        WHERE c.saga_name = s.saga_name AND c.ckey = s.concurrency_key AND c.running = 1
          AND NOT EXISTS (SELECT 1 FROM {{schema}}.saga_concurrency_queue w
                          WHERE w.saga_name = s.saga_name AND w.ckey = s.concurrency_key);
    IF FOUND THEN
        RETURN NULL;
    END IF;
    DELETE FROM {{schema}}.saga_concurrency_queue WHERE saga_id = s.id RETURNING * INTO q;
    IF FOUND THEN
        DELETE FROM {{schema}}.outbox WHERE id = q.command_id AND status = 'pending' AND available_at = 'infinity';
        RETURN NULL;
    END IF;
    UPDATE {{schema}}.saga_concurrency_keys SET running = running - 1
        WHERE saga_name = s.saga_name AND ckey = s.concurrency_key
        RETURNING max_slots, running INTO k_max, k_running;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    WHILE k_running < k_max LOOP
        DELETE FROM {{schema}}.saga_concurrency_queue
            WHERE seq = (SELECT w.seq FROM {{schema}}.saga_concurrency_queue w
                         WHERE w.saga_name = s.saga_name AND w.ckey = s.concurrency_key ORDER BY w.seq LIMIT 1)
            RETURNING * INTO q;
        EXIT WHEN NOT FOUND;
        k_running := k_running + 1;
        UPDATE {{schema}}.outbox SET available_at = clock_timestamp(), created_at = clock_timestamp()
            WHERE id = q.command_id AND status = 'pending' RETURNING topic INTO top;
        UPDATE {{schema}}.saga_instances SET next_check_at = clock_timestamp() + q.check_us * interval '1 microsecond'
            WHERE id = q.saga_id AND status IN ('running', 'compensating');
        INSERT INTO {{schema}}.saga_history (saga_id, event, step_name, direction, epoch, attempt, detail)
            SELECT q.saga_id, 'concurrency_admitted', w.step_name, w.direction, w.epoch, 0,
                   jsonb_build_object('concurrency_key', s.concurrency_key)
            FROM {{schema}}.saga_instances w WHERE w.id = q.saga_id;
        IF top IS NOT NULL THEN
            -- Wake the engines' workers, as a start does (see store.Channel).
            PERFORM pg_notify(TG_TABLE_SCHEMA || '_sagaflow', top);
        END IF;
    END LOOP;
    IF k_running = 0 THEN
        DELETE FROM {{schema}}.saga_concurrency_keys WHERE saga_name = s.saga_name AND ckey = s.concurrency_key;
    ELSE
        UPDATE {{schema}}.saga_concurrency_keys SET running = k_running
            WHERE saga_name = s.saga_name AND ckey = s.concurrency_key;
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

-- Listing a key's sagas (ListOpts.ConcurrencyKey, `sagaflow list
-- --concurrency-key`) finds them by this index, newest first, as the other
-- list filters do; sagas without a key are not in it.
CREATE INDEX saga_instances_concurrency_key ON {{schema}}.saga_instances (concurrency_key, created_at DESC, id DESC)
    WHERE concurrency_key IS NOT NULL;
