package steps

import (
	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/wire"
)

// Direction says whether a step runs its action or its compensation.
type Direction = wire.Direction

const (
	// Forward runs a step's action.
	Forward = wire.Forward
	// Compensate runs a step's compensation.
	Compensate = wire.Compensate
)

// Key identifies one logical execution of one step of one saga: every attempt
// and every duplicate delivery of it shares the key. It is [wire.Key] with
// the saga id as a uuid.UUID; its text is wire's canonical form.
type Key struct {
	SagaID    uuid.UUID
	Step      string
	Direction Direction
	Epoch     int
}

// Wire returns k as the wire package has it.
func (k Key) Wire() wire.Key {
	return wire.Key{SagaID: wire.UUID(k.SagaID), Step: k.Step, Direction: k.Direction, Epoch: k.Epoch}
}

// String returns the key in its canonical form, saga_id/step/direction/epoch
// (see [wire.Key]).
func (k Key) String() string { return k.Wire().String() }

// ParseKey parses a key written by [Key.String] (see [wire.ParseKey]).
func ParseKey(s string) (Key, error) {
	k, err := wire.ParseKey(s)
	if err != nil {
		return Key{}, err
	}
	return Key{SagaID: uuid.UUID(k.SagaID), Step: k.Step, Direction: k.Direction, Epoch: k.Epoch}, nil
}
