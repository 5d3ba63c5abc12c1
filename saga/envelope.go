package saga

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
)

// Outbox types of the engine's commands.
const (
	// commandType runs a saga's current step.
	commandType = "sagaflow.step"
	// cancelType asks an engine that knows the saga to cancel it.
	cancelType = "sagaflow.cancel"
)

// command is the payload of a step command. It points at the saga row, which
// holds the state; Version is the saga's version when the command was
// written, so a command is current exactly while the saga still has it.
type command struct {
	SagaID    uuid.UUID       `json:"saga_id"`
	Saga      string          `json:"saga"`
	Step      string          `json:"step"`
	Direction steps.Direction `json:"direction"`
	Epoch     int             `json:"epoch"`
	Version   int64           `json:"version"`
}

func decodeCommand(c *store.Claimed) (command, error) {
	var cmd command
	if c.Type != commandType && c.Type != cancelType {
		return cmd, fmt.Errorf("message type %q is neither %q nor %q", c.Type, commandType, cancelType)
	}
	dec := json.NewDecoder(bytes.NewReader(c.Payload))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&cmd); err != nil {
		return cmd, fmt.Errorf("decode payload: %w", err)
	}
	switch {
	case cmd.SagaID == uuid.Nil:
		return cmd, errors.New("saga_id is missing")
	case cmd.Saga == "" || cmd.Step == "":
		return cmd, errors.New("saga or step is missing")
	case !cmd.Direction.Valid():
		return cmd, fmt.Errorf("direction %q is neither %q nor %q", cmd.Direction, steps.Forward, steps.Compensate)
	case cmd.Version <= 0:
		return cmd, fmt.Errorf("version %d is not positive", cmd.Version)
	}
	return cmd, nil
}

// cancelMessage builds the command that makes an engine that knows sg look
// at its pending cancel request. It carries no authority of its own: an
// engine that finds no request in the database does nothing with it.
func (e *Engine) cancelMessage(sg *store.Saga) store.Message {
	cmd := command{SagaID: sg.ID, Saga: sg.Name, Step: sg.StepName, Direction: steps.Direction(sg.Direction),
		Epoch: sg.Epoch, Version: sg.Version}
	payload, _ := json.Marshal(cmd)
	id := uuid.Must(uuid.NewV7())
	m := store.Message{
		ID: id, Topic: e.commandTopic(sg.Name), Delivery: e.commandDelivery(),
		AggregateType: aggregateType(sg.Name), AggregateID: sg.ID.String(), Type: cancelType, Payload: payload,
		Headers: map[string]string{store.HeaderMessageID: id.String(), store.HeaderSagaID: sg.ID.String(), store.HeaderType: cancelType},
		SagaID:  &sg.ID,
	}
	e.sign(&m)
	return m
}

// commandMessage builds the outbox row of the command for a saga's step.
func (e *Engine) commandMessage(sagaID uuid.UUID, name, step string, dir steps.Direction, epoch int, version int64, delay time.Duration) store.Message {
	cmd := command{SagaID: sagaID, Saga: name, Step: step, Direction: dir, Epoch: epoch, Version: version}
	payload, _ := json.Marshal(cmd) // plain fields: cannot fail
	key := steps.Key{SagaID: sagaID, Step: step, Direction: dir, Epoch: epoch}.String()
	id := uuid.Must(uuid.NewV7())
	m := store.Message{
		ID: id, Topic: e.commandTopic(name), Delivery: e.commandDelivery(),
		AggregateType: aggregateType(name), AggregateID: sagaID.String(), Type: commandType, Payload: payload,
		Headers: map[string]string{
			store.HeaderMessageID: id.String(),
			store.HeaderSagaID:    sagaID.String(),
			store.HeaderStepKey:   key,
			store.HeaderType:      commandType,
		},
		SagaID: &sagaID, StepKey: &key, Delay: delay,
	}
	e.sign(&m)
	return m
}

// current reports whether cmd, which carries the saga's version, is the
// saga's current command in every other respect too: its step, direction
// and epoch, and, when the saga records it, the outbox id of the command
// written for this version. A command that passes the version fence but
// names another step, or is not the one the saga wrote (a forgery, or a
// copy sent early to skip a retry's backoff), is refused.
func (cmd command) current(c *store.Claimed, ls *store.LockedSaga) bool {
	if cmd.Step != ls.StepName || string(cmd.Direction) != ls.Direction || cmd.Epoch != ls.Epoch {
		return false
	}
	return ls.CommandID == nil || c.ID == uuid.Nil || c.ID == *ls.CommandID
}
