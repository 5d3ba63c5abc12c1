package saga_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// TestBadInputIsParkedAndTheWorkerKeepsServing feeds the executor every kind
// of bad input at once, then checks that each got a clear reason, nothing
// was dropped, and a healthy saga behind them still completed.
func TestBadInputIsParkedAndTheWorkerKeepsServing(t *testing.T) {
	t.Parallel()
	b := setup(t, &saga.Config{MaxStateBytes: 4096, UnknownSagaGrace: time.Hour})
	def := threeSteps(b, "bad-input", map[string]saga.StepFunc[order]{
		"charge/forward": func(_ context.Context, _ *saga.StepRun, s *order) error {
			if s.OrderID == "grow" {
				s.OrderID = strings.Repeat("x", 5000) // beyond MaxStateBytes
			}
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	insertRaw := func(typ, payload string, sagaID *uuid.UUID) uuid.UUID {
		id := uuid.New()
		_, err := b.pool.Exec(ctx, "INSERT INTO "+b.table("outbox")+
			` (id, topic, delivery, aggregatetype, aggregateid, type, payload, saga_id) VALUES ($1, 'sagaflow.commands', 'direct', 'saga.bad-input', 'x', $2, $3, $4)`,
			id, typ, []byte(payload), sagaID)
		require.NoError(t, err)
		return id
	}
	backdate := func(sagaID uuid.UUID) {
		_, err := b.pool.Exec(ctx, "UPDATE "+b.table("outbox")+" SET created_at = created_at - interval '2 hours', available_at = now() WHERE saga_id = $1", sagaID)
		require.NoError(t, err)
	}
	reason := func(id uuid.UUID) string {
		var status, lastErr string
		waitFor(t, 10*time.Second, func() bool {
			require.NoError(t, b.pool.QueryRow(ctx, "SELECT status, coalesce(last_error, '') FROM "+b.table("outbox")+" WHERE id = $1", id).Scan(&status, &lastErr))
			return status == "dead"
		}, "message %s to be parked", id)
		return lastErr
	}
	commandOf := func(sagaID uuid.UUID) uuid.UUID {
		var id uuid.UUID
		require.NoError(t, b.pool.QueryRow(ctx, "SELECT id FROM "+b.table("outbox")+" WHERE saga_id = $1", sagaID).Scan(&id))
		return id
	}

	// 1. Undecodable and wrong-typed commands.
	garbage := insertRaw("sagaflow.step", "{not json", nil)
	wrongType := insertRaw("orders.created", `{}`, nil)
	unknownField := insertRaw("sagaflow.step", `{"saga_id":"`+uuid.NewString()+`","saga":"x","step":"y","direction":"forward","epoch":0,"version":1,"extra":true}`, nil)
	// 2. A command for a saga instance that does not exist.
	ghostID := uuid.New()
	ghost := insertRaw("sagaflow.step", `{"saga_id":"`+ghostID.String()+`","saga":"bad-input","step":"reserve","direction":"forward","epoch":0,"version":1}`, &ghostID)
	// 3. A saga whose definition this engine does not know.
	foreign, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+" SET saga_name = 'renamed' WHERE id = $1", foreign.ID)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, "UPDATE "+b.table("outbox")+` SET payload = convert_to(replace(convert_from(payload, 'UTF8'), '"bad-input"', '"renamed"'), 'UTF8') WHERE saga_id = $1`, foreign.ID)
	require.NoError(t, err)
	// 4. A saga whose stored state no longer decodes into its type.
	undecodable, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+` SET state = '{"order_id": 42}' WHERE id = $1`, undecodable.ID)
	require.NoError(t, err)
	// 5. A saga whose current step is not in this engine's definition (an
	// older binary, a removed step), for longer than the grace period.
	lostStep, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+` SET step_name = 'removed' WHERE id = $1`, lostStep.ID)
	require.NoError(t, err)
	backdate(lostStep.ID)
	// 5b. A command of a saga type this engine does not know at all: it is
	// left alone for an engine that knows it.
	otherService := uuid.New()
	_, err = b.pool.Exec(ctx, "INSERT INTO "+b.table("outbox")+
		` (id, topic, delivery, aggregatetype, aggregateid, type, payload, saga_id) VALUES ($1, 'sagaflow.commands', 'direct', 'saga.shipping', 'x', 'sagaflow.step', '{}', $1)`, otherService)
	require.NoError(t, err)
	// 6. A step that leaves the state larger than allowed.
	grows, err := saga.Start(ctx, b.engine, def, order{OrderID: "grow"}, nil)
	require.NoError(t, err)
	// 7. And a healthy saga behind all of them.
	healthy, err := saga.Start(ctx, b.engine, def, order{OrderID: "fine"}, nil)
	require.NoError(t, err)

	b.start(t)

	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, healthy.ID).Status)

	in := b.waitTerminal(t, undecodable.ID)
	require.Equal(t, saga.StatusFailed, in.Status)
	require.Equal(t, saga.CodeStateDecode, in.LastError.Code)
	require.Contains(t, in.LastError.Message, "decode state")

	in = b.waitTerminal(t, lostStep.ID)
	require.Equal(t, saga.StatusFailed, in.Status)
	require.Equal(t, saga.CodeUnknownStep, in.LastError.Code)
	require.Contains(t, in.LastError.Message, `has no step "removed"`)
	require.Contains(t, reason(commandOf(lostStep.ID)), "no engine ran it within UnknownSagaGrace")

	in = b.waitTerminal(t, grows.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, saga.CodeTooLarge, in.LastError.Code)
	require.Contains(t, in.LastError.Message, "more than MaxStateBytes (4096)")
	require.Equal(t, []string{"reserve/forward", "reserve/compensate"}, b.effects(t, grows.ID))

	// Every bad command is parked as dead with its reason, none deleted.
	// Every bad command is parked as dead with its reason, none deleted.
	require.Contains(t, reason(garbage), "malformed command: decode payload")
	require.Contains(t, reason(wrongType), `message type "orders.created" is not "sagaflow.step", "sagaflow.cancel", "sagaflow.wake" or "sagaflow.branch"`)
	// A field this engine does not know is ignored (a newer engine may have
	// added it): the command decodes, and is parked only because its row
	// names no saga.
	require.Contains(t, reason(unknownField), "malformed command: payload names saga")
	require.Contains(t, reason(ghost), "saga "+ghostID.String()+" does not exist")
	// A saga whose definition this engine does not know is first left for
	// another engine (during a rolling deploy, say), its command deferred
	// with the reason; once older than the grace period it is parked.
	foreignMsg := commandOf(foreign.ID)
	waitFor(t, 10*time.Second, func() bool {
		var status, lastErr string
		require.NoError(t, b.pool.QueryRow(ctx, "SELECT status, coalesce(last_error, '') FROM "+b.table("outbox")+" WHERE id = $1", foreignMsg).Scan(&status, &lastErr))
		require.Equal(t, "pending", status)
		return strings.Contains(lastErr, `no definition named "renamed" at version 1 is registered with this engine (registered: bad-input)`)
	}, "the unknown saga's command to be deferred with its reason")
	backdate(foreign.ID)
	require.Contains(t, reason(foreignMsg), `no definition named "renamed" at version 1 is registered with this engine (registered: bad-input); no engine ran it within UnknownSagaGrace (1h0m0s)`)
	// The foreign saga itself is untouched (another engine may know it) but
	// its timeline says what happened.
	in, err = b.engine.Get(ctx, foreign.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StatusRunning, in.Status)
	require.Equal(t, saga.EventCommandParked, in.History[len(in.History)-1].Type)
	require.Equal(t, saga.CodeUnknownSaga, in.History[len(in.History)-1].ErrorCode)

	// The unknown saga type's command was never claimed.
	var attempts int
	var status string
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT status, attempts FROM "+b.table("outbox")+" WHERE id = $1", otherService).Scan(&status, &attempts))
	require.Equal(t, "pending", status)
	require.Zero(t, attempts)

	require.GreaterOrEqual(t, b.engine.Stats().Parked, int64(6))
}
