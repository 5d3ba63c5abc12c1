package wire

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// Command is the payload of a [TypeStep], [TypeCancel], [TypeWake] or [TypeBranch] message, which an
// engine sends to itself (through its outbox, or through Kafka): it points
// at the saga's row, which holds the state. Version is the saga's version
// when the command was written, so a step command is current exactly while
// the saga still has that version and position.
//
// A remote step's command, sent to a participant, is not a Command: its
// payload is whatever the step's definition sends, and its position travels
// in the headers ([HeaderStepKey], [HeaderDirection], [HeaderReplyTo]).
type Command struct {
	SagaID    UUID      `json:"saga_id"`
	Saga      string    `json:"saga"`
	Step      string    `json:"step"`
	Direction Direction `json:"direction"`
	Epoch     int       `json:"epoch"`
	Version   int64     `json:"version"`
}

// Key returns the step-scoped key of the step c runs.
func (c Command) Key() Key {
	return Key{SagaID: c.SagaID, Step: c.Step, Direction: c.Direction, Epoch: c.Epoch}
}

// EncodeCommand returns c's payload. It does not check c: the engine that
// writes it does.
func EncodeCommand(c Command) []byte {
	payload, err := json.Marshal(c)
	if err != nil {
		// Strings, numbers and a UUID: json.Marshal cannot fail on them.
		panic("wire: encode command: " + err.Error())
	}
	return payload
}

// DecodeCommand decodes the payload of a message of type typ, which must
// be [TypeStep], [TypeCancel], [TypeWake] or [TypeBranch]. Fields it does not know are ignored. It
// returns an error naming the field when a field has the wrong JSON type,
// holds a NUL byte or invalid UTF-8, is longer than allowed, or is missing
// (saga_id, saga, step, direction and a positive version are required).
//
// A cancel command written before cancel requests became rows carried a
// "reason"; such a command is refused, so that it is parked where an
// operator sees it rather than consumed as a wake-up.
func DecodeCommand(typ string, payload []byte) (Command, error) {
	var c Command
	if typ != TypeStep && typ != TypeCancel && typ != TypeWake && typ != TypeBranch {
		return c, fmt.Errorf("message type %q is not %q, %q, %q or %q", clip(typ), TypeStep, TypeCancel, TypeWake, TypeBranch)
	}
	var raw struct {
		SagaID    json.RawMessage `json:"saga_id"`
		Saga      json.RawMessage `json:"saga"`
		Step      json.RawMessage `json:"step"`
		Direction json.RawMessage `json:"direction"`
		Epoch     json.RawMessage `json:"epoch"`
		Version   json.RawMessage `json:"version"`
		Reason    json.RawMessage `json:"reason"`
	}
	if err := decodeObject(payload, &raw); err != nil {
		return c, err
	}
	var dir string
	for _, f := range []struct {
		name string
		raw  json.RawMessage
		into any
		want string
	}{
		{"saga_id", raw.SagaID, &c.SagaID, "a UUID string"},
		{"saga", raw.Saga, &c.Saga, "a string"},
		{"step", raw.Step, &c.Step, "a string"},
		{"direction", raw.Direction, &dir, "a string"},
		{"epoch", raw.Epoch, &c.Epoch, "an integer"},
		{"version", raw.Version, &c.Version, "an integer"},
	} {
		if err := decodeField(f.name, f.raw, f.into, f.want); err != nil {
			return Command{}, err
		}
	}
	c.Direction = Direction(dir)
	if typ == TypeCancel && present(raw.Reason) {
		return Command{}, errors.New(`decode payload: field "reason": a cancel command carries no reason any more; ` +
			"this one was written by an older engine (the cancel request in the database is what counts)")
	}
	for _, f := range []struct{ name, value string }{{"saga", c.Saga}, {"step", c.Step}, {"direction", dir}} {
		if err := CheckText(fmt.Sprintf("field %q", f.name), f.value, MaxNameBytes); err != nil {
			return Command{}, fmt.Errorf("decode payload: %w", err)
		}
	}
	switch {
	case c.SagaID.IsZero():
		return Command{}, errors.New("saga_id is missing")
	case c.Saga == "" || c.Step == "":
		return Command{}, errors.New("saga or step is missing")
	case strings.Contains(c.Step, "/"):
		return Command{}, fmt.Errorf("step %q contains '/', which no step name has", c.Step)
	case !c.Direction.Valid():
		return Command{}, fmt.Errorf("direction %q is neither %q nor %q", dir, Forward, Compensate)
	case c.Epoch < 0:
		return Command{}, fmt.Errorf("epoch %d is negative", c.Epoch)
	case c.Version <= 0:
		return Command{}, fmt.Errorf("version %d is not positive", c.Version)
	}
	return c, nil
}

// decodeObject decodes a JSON object into a struct of json.RawMessage
// fields.
func decodeObject(payload []byte, into any) error {
	if err := json.Unmarshal(payload, into); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return fmt.Errorf("decode payload: want a JSON object, got %s", describe(payload))
		}
		return fmt.Errorf("decode payload: %w", err)
	}
	return nil
}

// decodeField decodes one field's raw value into into, unless the field is
// absent or null. Its errors name the field and never quote more than a
// few bytes of the value.
func decodeField(name string, raw json.RawMessage, into any, want string) error {
	if !present(raw) {
		return nil
	}
	if !utf8Valid(raw) {
		return fmt.Errorf("decode payload: field %q is not valid UTF-8", name)
	}
	if err := json.Unmarshal(raw, into); err != nil {
		return fmt.Errorf("decode payload: field %q: want %s, got %s", name, want, describe(raw))
	}
	return nil
}

// present reports whether a field was given a value other than null.
func present(raw json.RawMessage) bool {
	return len(raw) > 0 && string(raw) != "null"
}

// describe names a JSON value for an error: short values as they are,
// long ones by kind and size.
func describe(raw []byte) string {
	const short = 64
	if len(raw) <= short && utf8Valid(raw) {
		return string(raw)
	}
	kind := "a value"
	if len(raw) > 0 {
		switch c := raw[0]; {
		case c == '"':
			kind = "a string"
		case c == '{':
			kind = "an object"
		case c == '[':
			kind = "an array"
		case c == '-' || '0' <= c && c <= '9':
			kind = "a number"
		}
	}
	return fmt.Sprintf("%s of %d bytes", kind, len(raw))
}

// clip bounds a string from the wire for an error message.
func clip(s string) string {
	const limit = 128
	if len(s) <= limit {
		return s
	}
	return s[:limit] + "…"
}
