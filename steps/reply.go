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
	// is false. A refusal is final: the saga compensates.
	Error string `json:"error,omitempty"`
	Code  string `json:"code,omitempty"`
}
