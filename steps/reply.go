package steps

import "github.com/sagaflow/sagaflow/wire"

// ReplyType is the message type of a participant's reply to a saga's
// command: wire.TypeReply.
const ReplyType = wire.TypeReply

// Reply is the payload of a participant's reply: the wire contract between
// a participant and the saga that sent it a command. See [wire.Reply].
type Reply = wire.Reply
