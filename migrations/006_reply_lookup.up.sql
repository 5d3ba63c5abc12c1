-- A participant that receives a command it has already answered (a
-- redelivery, or the engine's re-drive of a step whose reply was lost) sends
-- its latest reply for that step key again. That lookup read the whole
-- outbox; this index serves it. It covers reply rows only, so the engine's
-- own commands, the hot path, pay nothing for it.
CREATE INDEX outbox_reply_step_key ON {{schema}}.outbox (step_key, created_at)
    WHERE type = 'sagaflow.reply';
