// Package ui is sagaflow's web UI for operators: an [http.Handler] that an
// application mounts under a prefix of its own server, and that the CLI
// serves with `sagaflow ui`.
//
// Its pages are server-rendered HTML with a little JavaScript, all embedded
// in the binary: an overview (sagas by type and status, the top failures,
// the outbox and dead letters, steps per minute over the last hour), a
// filtered, paged list of sagas, one saga (its header, its definition drawn
// with where it is or stopped, its timeline and its state), and the dead
// messages and dead letters.
//
// Actions (resume, rerun from a step, cancel, bulk replay, requeue dead
// rows) each show a preview of what they will do, which steps and
// compensations run and which step keys are reused or new, before a
// confirmation. They use the engine's public operations; those on sagas
// are recorded in each saga's history with the name of who did them
// ([Config.Actor]), and requeues are logged with it.
//
// # Security
//
// The handler is read-only unless [Config.Authorize] is set, and then
// allows each action only when Authorize returns nil for the request. Every
// write is a POST that carries a per-browser token (a SameSite=Strict cookie
// and a form field that must match) and comes from the same origin
// (Origin and Sec-Fetch-Site are checked, and a POST with neither is
// refused); a GET never writes. One confirmation posted twice acts once.
// [Config.Hosts] names the hosts the UI answers, against DNS rebinding.
// Every
// stored string is escaped, control characters are shown as escapes, and
// the pages carry a Content-Security-Policy that runs no inline script.
// Saga state and message payloads are shown only through the redaction
// hooks [Config.Redact] and [Config.RedactPayload]; without them they are
// hidden.
//
// The handler does not authenticate anyone: put it behind the
// authentication of the server that mounts it, and name the user in
// [Config.Actor].
package ui
