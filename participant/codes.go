package participant

// Codes of the refusals a [Participant] sends on its own account, besides
// the codes its handlers attach with steps.WithCode. A saga receives them as
// the Code of a refused wire.Reply.
const (
	// CodeCompensatedBeforeRun refuses a forward command that arrived
	// after its step's compensation: the forward step is never run then,
	// since its compensation has already been done.
	CodeCompensatedBeforeRun = "compensated_before_run"
	// CodeMalformedCommand refuses a command whose payload does not decode.
	CodeMalformedCommand = "malformed_command"
	// CodePanic refuses a command whose handler panicked.
	CodePanic = "panic"
)

// Codes that start the reason of a command a [Participant] dead-letters
// without replying: the command cannot be trusted, or cannot be answered.
const (
	// CodeUnverified: signing is on, and the command's signature is
	// missing or matches no accepted key.
	CodeUnverified = "unverified"
	// CodeReplyTopicRefused: the command's sagaflow-reply-to names a topic
	// the participant does not reply to (see Config.ReplyTopics).
	CodeReplyTopicRefused = "reply_topic_refused"
	// CodeNotASagaCommand: the command's step key or reply topic is
	// missing, malformed or not storable, or its saga id or direction
	// header disagrees with its step key.
	CodeNotASagaCommand = "not_a_saga_command"
)
