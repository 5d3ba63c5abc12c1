package store

// Kafka header names that sagaflow sets on every message it publishes from
// the outbox, and that consumers read. They are the wire contract between
// the relay, the engine and the inbox, defined once here.
const (
	// HeaderMessageID is the outbox row's id: the key consumers deduplicate on.
	HeaderMessageID = "sagaflow-message-id"
	// HeaderType is the row's type column: what the message is.
	HeaderType = "sagaflow-type"
	// HeaderSagaID is the saga the message belongs to, when it has one.
	HeaderSagaID = "sagaflow-saga-id"
	// HeaderStepKey is the step-scoped idempotency key, when it has one.
	HeaderStepKey = "sagaflow-step-key"
)

// Headers of the commands a saga sends to participants.
const (
	// HeaderReplyTo names the topic the participant's reply goes to.
	HeaderReplyTo = "sagaflow-reply-to"
	// HeaderDirection is "forward" or "compensate".
	HeaderDirection = "sagaflow-direction"
)

// HeaderHeldSince is set on a Kafka command that an engine could not run
// yet and moved back to the outbox (see [Store.HoldMessage]): when it was
// first held, in the database's time (RFC 3339, UTC).
const HeaderHeldSince = "sagaflow-held-since"

// HeaderHeldID is the message id a held command had when it was first
// consumed: the id its saga recorded for it.
const HeaderHeldID = "sagaflow-held-id"

// LegalTopic reports whether t is a name Kafka accepts for a topic: 1 to 249
// of a-z, A-Z, 0-9, '.', '_' and '-', and neither "." nor "..".
func LegalTopic(t string) bool {
	if t == "" || len(t) > 249 || t == "." || t == ".." {
		return false
	}
	for i := 0; i < len(t); i++ {
		c := t[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}
