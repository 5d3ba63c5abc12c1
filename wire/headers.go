package wire

import "strings"

// HeaderPrefix starts the name of every header sagaflow reads or writes.
// A message that carries one of these headers more than once is ambiguous
// (one reader could take the first copy, another the last), and sagaflow
// refuses it.
const HeaderPrefix = "sagaflow-"

// Headers set on every message published from a sagaflow outbox.
const (
	// HeaderMessageID is the message's id, a UUID: the key consumers
	// deduplicate on.
	HeaderMessageID = "sagaflow-message-id"
	// HeaderType says what the message is: [TypeStep], [TypeCancel],
	// [TypeReply], or the command type of a remote step.
	HeaderType = "sagaflow-type"
	// HeaderSagaID is the saga the message belongs to, when it has one.
	HeaderSagaID = "sagaflow-saga-id"
	// HeaderStepKey is the step-scoped key ([Key]) of the step the message
	// belongs to, when it has one.
	HeaderStepKey = "sagaflow-step-key"
)

// Headers of the commands a saga sends to participants.
const (
	// HeaderReplyTo names the topic the participant's reply goes to.
	HeaderReplyTo = "sagaflow-reply-to"
	// HeaderDirection is the command's [Direction]: "forward" or
	// "compensate".
	HeaderDirection = "sagaflow-direction"
)

// HeaderSignature carries a message's signature when signing is on: see
// docs/protocol.md for what is signed and how.
const HeaderSignature = "sagaflow-signature"

// Headers of a command that an engine could not run yet and moved back to
// its outbox, to be published again later.
const (
	// HeaderHeldSince is when the command was first held, in the database's
	// time (RFC 3339, UTC).
	HeaderHeldSince = "sagaflow-held-since"
	// HeaderHeldID is the message id the command had when it was first
	// consumed: the id its saga recorded for it.
	HeaderHeldID = "sagaflow-held-id"
)

// IsOwnHeader reports whether name is a sagaflow header (starts with
// [HeaderPrefix]).
func IsOwnHeader(name string) bool { return strings.HasPrefix(name, HeaderPrefix) }

// Message types: the value of [HeaderType]. A remote step's command has the
// type the saga's definition names (for example "payments.charge").
const (
	// TypeStep runs a saga's current step. Its payload is a [Command].
	TypeStep = "sagaflow.step"
	// TypeCancel makes an engine that knows the saga look at its pending
	// cancel request. Its payload is a [Command]; it carries no authority
	// of its own.
	TypeCancel = "sagaflow.cancel"
	// TypeWake makes an engine that knows the saga look at what the saga
	// waits for (a signal arrived, a child saga ended). Its payload is a
	// [Command]; like a cancel, it carries no authority of its own.
	TypeWake = "sagaflow.wake"
	// TypeBranch runs one branch of a saga's parallel step; its payload is
	// a [Command] whose Step is "<step>.<branch>". Branch commands stay in
	// PostgreSQL (direct delivery).
	TypeBranch = "sagaflow.branch"
	// TypeReply is a participant's reply to a saga's command. Its payload
	// is a [Reply].
	TypeReply = "sagaflow.reply"
)
