-- The W3C trace context a saga was started under (see docs/observability.md):
-- the traceparent header's value, then, when there is one, a newline and the
-- tracestate header's value. Every span of the saga's steps is a child of
-- it, and every message the saga writes carries it on, so that one saga is
-- one trace across every service it calls. NULL when the saga was started
-- without tracing (and for sagas started before this migration).
ALTER TABLE {{schema}}.saga_instances ADD COLUMN trace_context text;
