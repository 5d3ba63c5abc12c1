package saga

import (
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

// Outbox types of the engine's commands.
const (
	// commandType runs a saga's current step.
	commandType = wire.TypeStep
	// cancelType asks an engine that knows the saga to cancel it.
	cancelType = wire.TypeCancel
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
	w, err := wire.DecodeCommand(c.Type, c.Payload)
	if err != nil {
		return command{}, err
	}
	return command{SagaID: uuid.UUID(w.SagaID), Saga: w.Saga, Step: w.Step, Direction: w.Direction, Epoch: w.Epoch,
		Version: w.Version}, nil
}

// cancelMessage builds the command that makes an engine that knows sg look
// at its pending cancel request. It carries no authority of its own: an
// engine that finds no request in the database does nothing with it.
func (e *Engine) cancelMessage(sg *store.Saga) store.Message { return e.nudgeMessage(sg, cancelType) }

// nudgeMessage builds a command of type typ (cancelType or wakeType) that
// makes an engine that knows sg look at it. It names the saga's position
// when written, for the reader's sake; the engine goes by the saga's row.
func (e *Engine) nudgeMessage(sg *store.Saga, typ string) store.Message {
	return e.nudgeAt(sg.ID, sg.Name, sg.DefVersion, sg.StepName, steps.Direction(sg.Direction), sg.Epoch, sg.Version, typ)
}

// nudgeAt builds a command of type typ for saga id of name at definition
// version defVersion.
func (e *Engine) nudgeAt(id uuid.UUID, name string, defVersion int, step string, dir steps.Direction, epoch int, version int64, typ string) store.Message {
	m := e.engineMessage(wire.Command{SagaID: wire.UUID(id), Saga: name, Step: step, Direction: dir, Epoch: epoch,
		Version: max(version, 1)}, defVersion, typ)
	e.sign(&m)
	return m
}

// commandMessage builds the outbox row of the command for a saga's step,
// due after delay, for a saga at definition version defVersion; it carries
// the step's key.
func (e *Engine) commandMessage(sagaID uuid.UUID, name string, defVersion int, step string, dir steps.Direction, epoch int, version int64, delay time.Duration) store.Message {
	c := wire.Command{SagaID: wire.UUID(sagaID), Saga: name, Step: step, Direction: dir, Epoch: epoch, Version: version}
	m := e.engineMessage(c, defVersion, commandType)
	key := c.Key().String()
	m.Headers[wire.HeaderStepKey] = key
	m.StepKey, m.Delay = &key, delay
	e.sign(&m)
	return m
}

// engineMessage is the unsigned outbox row of an engine command of type typ
// with payload c, on the saga type's command topic, keyed by saga id; its
// aggregatetype names the saga's definition version defVersion.
func (e *Engine) engineMessage(c wire.Command, defVersion int, typ string) store.Message {
	id := uuid.UUID(c.SagaID)
	mid := uuid.Must(uuid.NewV7())
	return store.Message{
		ID: mid, Topic: e.commandTopic(c.Saga), Delivery: e.commandDelivery(),
		AggregateType: aggregateType(c.Saga, defVersion), AggregateID: id.String(), Type: typ, Payload: wire.EncodeCommand(c),
		Headers: map[string]string{wire.HeaderMessageID: mid.String(), wire.HeaderSagaID: id.String(), wire.HeaderType: typ},
		SagaID:  &id,
	}
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
