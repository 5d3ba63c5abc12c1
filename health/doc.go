// Package health is the one shape of sagaflow's health reports, and an
// [http.Handler] that serves them as liveness and readiness probes.
//
// Each long-running part reports in the same shape, a [Report] of named
// [Check]s: saga.Engine.Health, relay.Relay.Check and
// inbox.Consumer.Health. A report is live unless the part should be
// restarted (it runs, but its goroutines died), and ready when every check
// passes (the schema is migrated to this build's version, the workers run,
// the last claim succeeded, LISTEN is connected, the broker is reachable).
// The database reads of a check go again on another connection when the
// one they got was broken (by a database restart, say, before the pool
// noticed), so that the first probe after a restart reports the database,
// not a dead pooled connection.
//
//	mux.Handle("/healthz/", health.Handler(engine.Health, rel.Check, consumer.Health))
//
// GET /healthz/livez answers 200 when every report is live and 503
// otherwise; GET /healthz/readyz answers 200 when every report is ready.
// Both bodies are the reports as JSON. A report never carries a payload or
// a secret, only the components' own error texts.
package health
