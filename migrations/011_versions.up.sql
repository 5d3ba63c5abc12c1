-- Versions: a saga runs to its end on the version of its definition it
-- started with, unless an operator migrates it to another.
--
-- def_version is that version (1 for every saga started before versions
-- existed). Commands of a saga at version 1 keep the aggregatetype
-- 'saga.<name>'; at a later version v they carry 'saga.<name>@v<v>', so an
-- engine claims only the commands of the versions it registered and leaves
-- the others to engines that have them. parent_version is, for a child saga,
-- its parent's version: the child's end wakes the parent with a command of
-- the parent's version.
ALTER TABLE {{schema}}.saga_instances ADD COLUMN def_version integer NOT NULL DEFAULT 1 CHECK (def_version >= 1);
ALTER TABLE {{schema}}.saga_instances ADD COLUMN parent_version integer;

-- A type's pause covers every version of it.
CREATE OR REPLACE FUNCTION {{schema}}.saga_hold_paused() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'pending' AND NEW.available_at <> 'infinity' AND EXISTS (
        SELECT 1 FROM {{schema}}.saga_pauses p
        WHERE (p.kind = 'saga' AND p.saga_id = NEW.saga_id)
           OR (p.kind = 'type' AND (NEW.aggregatetype = 'saga.' || p.saga_name
                                    OR starts_with(NEW.aggregatetype, 'saga.' || p.saga_name || '@')))) THEN
        NEW.paused_from := NEW.available_at;
        NEW.available_at := 'infinity';
    END IF;
    RETURN NEW;
END $$;
