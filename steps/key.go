package steps

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/google/uuid"
)

// Direction says whether a step runs its action or its compensation.
type Direction string

const (
	// Forward runs a step's action.
	Forward Direction = "forward"
	// Compensate runs a step's compensation.
	Compensate Direction = "compensate"
)

// Valid reports whether d is Forward or Compensate.
func (d Direction) Valid() bool { return d == Forward || d == Compensate }

// Key identifies one logical execution of one step of one saga: every attempt
// and every duplicate delivery of it shares the key.
type Key struct {
	SagaID    uuid.UUID
	Step      string
	Direction Direction
	Epoch     int
}

// String returns the key as saga_id/step/direction/epoch.
func (k Key) String() string {
	return k.SagaID.String() + "/" + k.Step + "/" + string(k.Direction) + "/" + strconv.Itoa(k.Epoch)
}

// ParseKey parses a key written by [Key.String].
func ParseKey(s string) (Key, error) {
	parts := strings.Split(s, "/")
	if len(parts) != 4 {
		return Key{}, fmt.Errorf("steps: parse key %q: want saga_id/step/direction/epoch", s)
	}
	id, err := uuid.Parse(parts[0])
	if err != nil {
		return Key{}, fmt.Errorf("steps: parse key %q: saga id: %w", s, err)
	}
	if parts[1] == "" {
		return Key{}, fmt.Errorf("steps: parse key %q: empty step name", s)
	}
	dir := Direction(parts[2])
	if !dir.Valid() {
		return Key{}, fmt.Errorf("steps: parse key %q: direction %q is neither %q nor %q", s, parts[2], Forward, Compensate)
	}
	epoch, err := strconv.Atoi(parts[3])
	if err != nil || epoch < 0 {
		return Key{}, fmt.Errorf("steps: parse key %q: epoch %q is not a non-negative integer", s, parts[3])
	}
	return Key{SagaID: id, Step: parts[1], Direction: dir, Epoch: epoch}, nil
}
