-- Parallel groups: a step whose branches run at once, each its own fenced,
-- deduplicated step with its own key ('<step>.<branch>'), joined when all
-- have completed.
--
-- A saga in a group waits for its branches (wait_kind 'branches'): its row
-- stays at the group's step, and each branch has a row here with its status,
-- attempts and result. A branch's command is a direct outbox row of type
-- 'sagaflow.branch'. A branch that completes writes its row in the
-- transaction that commits its effects, under the saga's row lock, so the
-- last one to complete sees every other and joins.
ALTER TABLE {{schema}}.saga_instances DROP CONSTRAINT saga_instances_wait_kind_check;
ALTER TABLE {{schema}}.saga_instances ADD CONSTRAINT saga_instances_wait_kind_check
    CHECK (wait_kind IN ('timer', 'signal', 'child', 'branches'));

CREATE TABLE {{schema}}.saga_branches (
    saga_id    uuid        NOT NULL,
    epoch      integer     NOT NULL,
    step       text        NOT NULL,
    branch     text        NOT NULL,
    -- running (its command is pending or runs), completed, failed (for
    -- good), cancelled (the group failed, or the saga was cancelled).
    status     text        NOT NULL CHECK (status IN ('running', 'completed', 'failed', 'cancelled')),
    attempt    integer     NOT NULL DEFAULT 0,
    -- The branch's result, JSON as bytes, for the group's join and the
    -- branch's compensation.
    result     bytea,
    last_error text,
    error_code text,
    started_at timestamptz NOT NULL DEFAULT now(),
    ended_at   timestamptz,
    PRIMARY KEY (saga_id, epoch, step, branch)
);
