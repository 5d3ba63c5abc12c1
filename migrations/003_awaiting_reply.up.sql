-- A saga whose current step sent a command to another service and waits
-- for its reply. Its deadline is then the reply timeout.
ALTER TABLE {{schema}}.saga_instances ADD COLUMN awaiting_reply boolean NOT NULL DEFAULT false;
