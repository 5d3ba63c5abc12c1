-- Inbound HTTP idempotency keys (package idempotency). A row is inserted
-- in_flight before the handler runs (the insert is the lock: it commits at
-- once, so a concurrent duplicate sees it) and becomes done with the
-- response the handler produced. A row whose expires_at has passed counts as
-- absent: the next request with its key replaces it.
CREATE TABLE {{schema}}.idempotency_keys (
    scope            text        NOT NULL,
    key              text        NOT NULL,
    -- sha256 of the request's method, path and query, and body.
    request_hash     bytea       NOT NULL,
    status           text        NOT NULL CHECK (status IN ('in_flight', 'done')),
    -- The stored response, set when status is 'done'.
    response_status  integer,
    response_headers jsonb,
    response_body    bytea,
    -- When the key was claimed; it also fences the claim, so that a
    -- request whose key expired and was claimed again cannot store or
    -- release the new claim.
    created_at       timestamptz NOT NULL DEFAULT now(),
    expires_at       timestamptz NOT NULL,
    PRIMARY KEY (scope, key),
    CONSTRAINT idempotency_keys_done_has_response CHECK (status = 'in_flight' OR response_status IS NOT NULL)
);
-- Retention of expired keys, oldest first.
CREATE INDEX idempotency_keys_expires_at ON {{schema}}.idempotency_keys (expires_at);
