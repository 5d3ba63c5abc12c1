package saga_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/saga"
)

func TestNilArgumentsAreErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	def := saga.Define("nil-args", saga.Step[order]{Name: "a", Action: noop})
	var nilEngine *saga.Engine
	for name, e := range map[string]*saga.Engine{"nil": nilEngine, "zero value": {}} {
		t.Run(name, func(t *testing.T) {
			for op, err := range map[string]error{
				"Start":         second(saga.Start(ctx, e, def, order{}, nil)),
				"StartTx":       second(saga.StartTx(ctx, e, nil, def, order{}, nil)),
				"Schedule":      saga.Schedule(e, "@hourly", def, order{}, nil),
				"Register":      e.Register(def),
				"Engine.Start":  e.Start(ctx),
				"Stop":          e.Stop(ctx),
				"StopAndCancel": e.StopAndCancel(ctx),
				"Get":           second(e.Get(ctx, uuid.New())),
				"List":          second(e.List(ctx, nil)),
				"Resume":        e.Resume(ctx, uuid.New(), "x"),
				"Rerun":         e.Rerun(ctx, uuid.New(), "a", "x"),
				"ReplayBulk":    second(e.ReplayBulk(ctx, saga.BulkReplayOpts{})),
				"ReplayOutbox":  second(e.ReplayOutbox(ctx, outbox.ReplayOpts{})),
				"OutboxStatus":  second(e.OutboxStatus(ctx)),
				"Cancel":        e.Cancel(ctx, uuid.New(), "x"),
				"CancelTx":      e.CancelTx(ctx, nil, uuid.New(), "x"),
				"RequestCancel": e.RequestCancel(ctx, uuid.New(), "x"),
				"RescueNow":     second(e.RescueNow(ctx)),
				"RunRetention":  second(e.RunRetention(ctx)),
			} {
				require.ErrorIs(t, err, saga.ErrNilEngine, op)
			}
			require.Equal(t, saga.Stats{}, e.Stats())
			require.Nil(t, e.CommandTopics())
		})
	}

	e, err := saga.New(dummyPool(t), nil)
	require.NoError(t, err)
	var nilDef *saga.Definition[order]
	require.Empty(t, nilDef.Name())
	err = e.Register(nilDef)
	require.ErrorIs(t, err, saga.ErrInvalidDefinition)
	require.ErrorContains(t, err, "nil definition")
	require.ErrorIs(t, e.Register(nil), saga.ErrInvalidDefinition)
	require.NoError(t, e.Register(def))
	_, err = saga.Start(ctx, e, nilDef, order{}, nil)
	require.ErrorContains(t, err, "nil definition")
	_, err = saga.StartTx(ctx, e, nil, def, order{}, nil)
	require.ErrorContains(t, err, `saga: start nil-args: tx is nil`)
	require.ErrorContains(t, saga.Schedule(e, "@hourly", nilDef, order{}, nil), "nil definition")
}

func second[T any](_ T, err error) error { return err }
