package wire

import (
	"encoding/json"
	"fmt"
	"unicode/utf8"
)

// Reply is the payload of a [TypeReply] message: a participant's answer to
// a saga's command, sent to the command's [HeaderReplyTo] topic with the
// command's [HeaderSagaID] and [HeaderStepKey].
type Reply struct {
	// OK is true when the participant carried the command out.
	OK bool `json:"ok"`
	// Result is the participant's result, for the saga's OnReply.
	Result json.RawMessage `json:"result,omitempty"`
	// Error and Code say why the participant refused the command, when OK
	// is false. A refusal is final: the saga compensates. A participant
	// should make both storable before it sends them (no NUL byte, valid
	// UTF-8, at most MaxReplyErrorBytes and MaxReplyCodeBytes); the engine
	// makes them so in any case (a NUL byte becomes \0, invalid UTF-8
	// becomes U+FFFD, and they are cut), rather than refuse a refusal.
	Error string `json:"error,omitempty"`
	Code  string `json:"code,omitempty"`
	// InReplyTo is the sagaflow-message-id of the command this reply
	// answers, "" when the participant does not say (on the wire: absent,
	// null or ""). The engine drops a
	// refusal that answers another command than the one its saga waits
	// for: a copy of a refusal sent before the saga was resumed must not
	// fail the step that the resume sent again under the same key. A
	// success is applied whatever command it answers: the step ran.
	InReplyTo string `json:"in_reply_to,omitempty"`
}

// Bounds of a refusal's text and code.
const (
	MaxReplyErrorBytes = 2000
	MaxReplyCodeBytes  = 200
)

// EncodeReply returns r's payload. It fails only when r.Result is not
// valid JSON.
func EncodeReply(r Reply) ([]byte, error) { return json.Marshal(r) }

// DecodeReply decodes a reply's payload. Fields it does not know are
// ignored, and so is a field that is null. It returns an error naming the
// field when "ok" is not a boolean, or "error", "code" or "in_reply_to" is
// not a string. Their text is taken as
// encoding/json takes it (invalid UTF-8 becomes U+FFFD) and otherwise as it
// was sent, however long and whatever it holds: a refusal is never refused
// for its text (see [Reply]). "result" is returned as it was sent, for the
// saga's OnReply to decode.
func DecodeReply(payload []byte) (Reply, error) {
	var raw struct {
		OK        json.RawMessage `json:"ok"`
		Result    json.RawMessage `json:"result"`
		Error     json.RawMessage `json:"error"`
		Code      json.RawMessage `json:"code"`
		InReplyTo json.RawMessage `json:"in_reply_to"`
	}
	if err := decodeObject(payload, &raw); err != nil {
		return Reply{}, err
	}
	r := Reply{Result: raw.Result}
	for _, f := range []struct {
		name string
		raw  json.RawMessage
		into any
		want string
	}{
		{"ok", raw.OK, &r.OK, "true or false"},
		{"error", raw.Error, &r.Error, "a string"},
		{"code", raw.Code, &r.Code, "a string"},
		{"in_reply_to", raw.InReplyTo, &r.InReplyTo, "a string"},
	} {
		if !present(f.raw) {
			continue
		}
		if err := json.Unmarshal(f.raw, f.into); err != nil {
			return Reply{}, fmt.Errorf("decode payload: field %q: want %s, got %s", f.name, f.want, describe(f.raw))
		}
	}
	return r, nil
}

func utf8Valid(b []byte) bool { return utf8.Valid(b) }
