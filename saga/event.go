package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/steps"
)

// SignalOn returns an inbox handler (for an [inbox.Consumer] on any topic)
// that turns each message into the signal called name: it decodes the
// message's value as JSON into E, asks route which saga it is for, and
// sends the signal in the inbox's transaction, so that the message is
// recorded as processed exactly when its signal is. The event is the
// signal's payload and the message id ([inbox.Message].ID) its ID, unless
// route sets them: a redelivered message has no second effect, neither
// through the inbox nor through the signal's id.
//
// route returns the address (Signal.SagaID, or Saga and BusinessKey); the
// carrier's ShipmentDelivered{order_id}, say, becomes
// saga.Signal{Saga: "fulfilment", BusinessKey: ev.OrderID}.
//
// A message that does not decode, that route refuses, or whose signal
// cannot be stored is dead-lettered by the consumer, with the reason. A
// signal for a saga that has ended or does not exist is recorded as
// rejected ([ErrSignalRejected], see [Engine.Signals]) and the message
// counts as processed: it is kept there, not retried.
func SignalOn[E any](e *Engine, name string, route func(msg inbox.Message, ev E) (Signal, error)) inbox.HandlerFunc {
	return func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
		if err := e.ready("SignalOn"); err != nil {
			return err
		}
		var ev E
		if err := json.Unmarshal(msg.Value, &ev); err != nil {
			return steps.Permanent(fmt.Errorf("signal %q: the message does not decode into %T: %w", name, ev, err))
		}
		if route == nil {
			return steps.Permanent(fmt.Errorf("signal %q: SignalOn has no route", name))
		}
		sig, err := route(msg, ev)
		if err != nil {
			return steps.Permanent(fmt.Errorf("signal %q: route: %w", name, err))
		}
		if sig.Name == "" {
			sig.Name = name
		}
		if sig.ID == "" {
			// As the inbox records it: the id itself, or sha256:<hex> of one
			// that an indexed column cannot hold.
			sig.ID = safetext.Key(msg.ID)
		}
		if sig.Payload == nil {
			sig.Payload = json.RawMessage(msg.Value)
		}
		_, err = e.SignalTx(ctx, tx, sig)
		switch {
		case errors.Is(err, ErrSignalRejected):
			e.log.WarnContext(ctx, "sagaflow recorded a signal from the bus that no saga can take",
				slog.String("signal", safetext.Text(sig.Name, 200)), slog.String("message_id", safetext.Text(msg.ID, 200)),
				slog.String("why", err.Error()))
			return nil
		case errors.Is(err, ErrInvalidInput):
			return steps.Permanent(err)
		}
		return err
	}
}
