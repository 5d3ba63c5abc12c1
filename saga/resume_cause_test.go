package saga_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

func TestResumeKeepsTheFailureCause(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var refundsWork atomic.Bool
	def := threeSteps(b, "cause", map[string]saga.StepFunc[order]{
		"ship/forward": func(context.Context, *saga.StepRun, *order) error {
			return steps.Permanent(steps.WithCode("no_carrier", errors.New("no carrier")))
		},
		"charge/compensate": func(context.Context, *saga.StepRun, *order) error {
			if !refundsWork.Load() {
				return steps.Permanent(steps.WithCode("refund_rejected", errors.New("payment provider rejects refunds")))
			}
			return nil
		},
	})
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	in := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusFailed, in.Status)
	require.Equal(t, &saga.ErrorInfo{Code: "refund_rejected", Message: "payment provider rejects refunds", Step: "charge"}, in.LastError)

	refundsWork.Store(true)
	require.NoError(t, b.engine.Resume(ctx, st.ID, "refunds work again"))
	in = b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	// The saga compensated because ship failed: that is its last error
	// again, once the compensation that failed has succeeded.
	require.Equal(t, &saga.ErrorInfo{Code: "no_carrier", Message: "no carrier", Step: "ship"}, in.LastError)
	// The timeline keeps the failure the resume went past.
	resumed := findEvent(t, in, saga.EventSagaResumed)
	require.Equal(t, "refund_rejected", resumed.ErrorCode)
	require.Equal(t, "payment provider rejects refunds", resumed.Error)
	require.Equal(t, "charge", jsonField(t, resumed.Detail, "failed_step"))
	require.Equal(t, "refunds work again", jsonField(t, resumed.Detail, "reason"))
}

func TestResumeKeepsTheErrorUntilTheStepSucceeds(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "decode-cause", nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+` SET state = '{"order_id": 7}' WHERE id = $1`, st.ID)
	require.NoError(t, err)
	// Another engine runs the saga into the ground; this one (not started)
	// resumes it, so that nothing runs between the resume and the reads.
	runner, err := saga.New(b.pool, &saga.Config{Schema: b.schema, PollInterval: 100 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	require.NoError(t, runner.Register(def))
	require.NoError(t, runner.Start(ctx))
	in := b.waitTerminal(t, st.ID)
	require.NoError(t, runner.Stop(ctx))
	require.Equal(t, saga.StatusFailed, in.Status)
	cause := in.LastError
	require.Equal(t, saga.CodeStateDecode, cause.Code)

	_, err = b.pool.Exec(ctx, "UPDATE "+b.table("saga_instances")+` SET state = '{"order_id": "7"}' WHERE id = $1`, st.ID)
	require.NoError(t, err)
	require.NoError(t, b.engine.Resume(ctx, st.ID, "state repaired"))
	in, err = b.engine.Get(ctx, st.ID)
	require.NoError(t, err)
	require.Equal(t, saga.StatusRunning, in.Status)
	require.Equal(t, cause, in.LastError, "the error stays until the step succeeds")
	resumed := findEvent(t, in, saga.EventSagaResumed)
	require.Equal(t, cause.Code, resumed.ErrorCode)
	require.Equal(t, cause.Message, resumed.Error)

	b.start(t)
	in = b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Nil(t, in.LastError)
	require.Equal(t, saga.CodeStateDecode, findEvent(t, in, saga.EventSagaResumed).ErrorCode)
}

func findEvent(t *testing.T, in *saga.Instance, typ string) saga.Event {
	t.Helper()
	for _, ev := range in.History {
		if ev.Type == typ {
			return ev
		}
	}
	t.Fatalf("no %s event in %v", typ, eventTypes(in))
	return saga.Event{}
}
