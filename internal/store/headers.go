package store

import "github.com/sagaflow/sagaflow/wire"

// Kafka header names, as package wire names them (the wire protocol has
// one owner; these keep the store's callers short).
const (
	HeaderMessageID = wire.HeaderMessageID
	HeaderType      = wire.HeaderType
	HeaderSagaID    = wire.HeaderSagaID
	HeaderStepKey   = wire.HeaderStepKey
	HeaderReplyTo   = wire.HeaderReplyTo
	HeaderDirection = wire.HeaderDirection
	// HeaderHeldSince is set on a Kafka command that an engine could not
	// run yet and moved back to the outbox (see [Store.HoldMessage]).
	HeaderHeldSince = wire.HeaderHeldSince
	// HeaderHeldID is the message id a held command had when it was first
	// consumed: the id its saga recorded for it.
	HeaderHeldID = wire.HeaderHeldID
)

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
