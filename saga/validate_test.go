package saga_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

func TestScheduleRefusesSpecsCronCannotKeep(t *testing.T) {
	t.Parallel()
	e, err := saga.New(dummyPool(t), nil)
	require.NoError(t, err)
	def := saga.Define("every", saga.Step[order]{Name: "a", Action: noop})
	require.NoError(t, e.Register(def))
	for _, tc := range []struct{ spec, want string }{
		{"@every 0s", "the interval must be at least 1s"},
		{"@every -5s", "the interval must be at least 1s"},
		{"@every 500ms", "the interval must be at least 1s"},
		{"@every 1500ms", "the interval must be whole seconds"},
		{"@every soon", `time: invalid duration "soon"`},
		{"TZ=UTC", "a time zone must be followed by a spec"},
		{"", "empty spec"},
	} {
		err := saga.Schedule(e, tc.spec, def, order{}, &saga.ScheduleOpts{Name: tc.spec})
		require.ErrorContains(t, err, `saga: schedule "`+tc.spec+`": `+tc.want, tc.spec)
	}
	for _, spec := range []string{"@every 1s", "@every 1m30s", "*/5 * * * *", "TZ=Europe/Paris 0 3 * * *"} {
		require.NoError(t, saga.Schedule(e, spec, def, order{}, &saga.ScheduleOpts{Name: spec}), spec)
	}
}

func TestNegativeRetryLimitsAreRefused(t *testing.T) {
	t.Parallel()
	e, err := saga.New(dummyPool(t), nil)
	require.NoError(t, err)
	for _, tc := range []struct {
		step saga.Step[order]
		want string
	}{
		{saga.Step[order]{Name: "a", Action: noop, Retry: &saga.RetryPolicy{MaxAttempts: -1}},
			`saga "retries" step "a": Retry.MaxAttempts is -1`},
		{saga.Step[order]{Name: "a", Action: noop, Compensate: noop, CompensateRetry: &saga.RetryPolicy{MaxAttempts: -3}},
			`saga "retries" step "a": CompensateRetry.MaxAttempts is -3`},
	} {
		err := e.Register(saga.Define("retries", tc.step))
		require.ErrorIs(t, err, saga.ErrInvalidDefinition)
		require.ErrorContains(t, err, tc.want)
	}
}
