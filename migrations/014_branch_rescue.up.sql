-- The rescuer finds a parallel step's branch whose command was lost (deleted,
-- or parked as dead): the branch is running and no pending command carries
-- its step key. This index answers "is that branch's command pending?" with
-- one lookup. It covers branch commands only, so a plain step's command, the
-- hot path, pays nothing for it.
CREATE INDEX outbox_branch_pending ON {{schema}}.outbox (step_key)
    WHERE type = 'sagaflow.branch' AND status = 'pending';
