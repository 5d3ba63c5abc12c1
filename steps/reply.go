package steps

import "encoding/json"

// ReplyType is the message type of a participant's reply to a saga's
// command.
const ReplyType = "sagaflow.reply"

// Reply is the payload of a participant's reply: the wire contract between
// a participant and the saga that sent it a command.
type Reply struct {
	// OK is true when the participant carried the command out.
	OK bool `json:"ok"`
	// Result is the participant's result, for the saga's OnReply.
	Result json.RawMessage `json:"result,omitempty"`
	// Error and Code say why the participant refused the command, when OK
	// is false. A refusal is final: the saga compensates. A participant
	// makes both storable before it sends them (a NUL byte becomes \0,
	// invalid UTF-8 becomes U+FFFD, and they are cut to 2,000 and 200
	// bytes).
	Error string `json:"error,omitempty"`
	Code  string `json:"code,omitempty"`
}

// Codes of the refusals a [Participant] sends on its own account, besides
// the codes its handlers attach with [WithCode].
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
	// the participant does not reply to (see ParticipantConfig.ReplyTopics).
	CodeReplyTopicRefused = "reply_topic_refused"
	// CodeNotASagaCommand: the command's step key or reply topic is
	// missing, malformed or not storable, or its saga id or direction
	// header disagrees with its step key.
	CodeNotASagaCommand = "not_a_saga_command"
)
