package saga_test

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

func noop(context.Context, *saga.StepRun, *order) error { return nil }

func TestRegisterRejectsBadDefinitions(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		def  saga.AnyDefinition
		want string
	}{
		{"empty name", saga.Define("", saga.Step[order]{Name: "a", Action: noop}), `saga name ""`},
		{"bad name", saga.Define("a/b", saga.Step[order]{Name: "a", Action: noop}), `saga name "a/b"`},
		{"no steps", saga.Define[order]("none"), `saga "none" has no steps`},
		{"duplicate step", saga.Define("dup", saga.Step[order]{Name: "a", Action: noop}, saga.Step[order]{Name: "a", Action: noop}), `saga "dup" has two steps named "a"`},
		{"step name with slash", saga.Define("s", saga.Step[order]{Name: "a/b", Action: noop}), `step 0: name "a/b"`},
		{"no action", saga.Define("s", saga.Step[order]{Name: "a"}), `step "a" has no Action`},
		{"negative timeout", saga.Define("s", saga.Step[order]{Name: "a", Action: noop, Timeout: -time.Second}), `negative Timeout`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, err := saga.New(dummyPool(t), nil)
			require.NoError(t, err)
			err = e.Register(tc.def)
			require.ErrorIs(t, err, saga.ErrInvalidDefinition)
			require.ErrorContains(t, err, tc.want)
		})
	}

	e, err := saga.New(dummyPool(t), nil)
	require.NoError(t, err)
	require.NoError(t, e.Register(saga.Define("once", saga.Step[order]{Name: "a", Action: noop})))
	err = e.Register(saga.Define("once", saga.Step[order]{Name: "b", Action: noop}))
	require.ErrorIs(t, err, saga.ErrInvalidDefinition)
	require.ErrorContains(t, err, `a saga named "once" is already registered`)
	err = e.Register(saga.Define("twice", saga.Step[order]{Name: "a", Action: noop}), saga.Define("twice", saga.Step[order]{Name: "a", Action: noop}))
	require.ErrorContains(t, err, `"twice" is already registered`)
}

func TestConfigErrorsNameTheField(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cfg  saga.Config
		want string
	}{
		{saga.Config{Schema: `x"; DROP TABLE users; --`}, "Schema"},
		{saga.Config{Schema: "pg_catalog"}, "reserved pg_ prefix"},
		{saga.Config{Workers: -1}, "Workers"},
		{saga.Config{BatchSize: saga.BatchSizeMax + 1}, "BatchSize must be between 1 and 32"},
		{saga.Config{PollInterval: -1}, "PollInterval"},
		{saga.Config{MaxStateBytes: -1}, "MaxStateBytes"},
		{saga.Config{MaxCommandBytes: -1}, "MaxCommandBytes"},
		{saga.Config{Kafka: &saga.KafkaConfig{}}, "Kafka.Brokers is empty and Kafka.NewReader is not set"},
		{saga.Config{Kafka: &saga.KafkaConfig{Brokers: []string{"127.0.0.1:9"}, SessionTimeout: time.Millisecond}}, "Kafka.SessionTimeout 1ms"},
		{saga.Config{Kafka: &saga.KafkaConfig{Brokers: []string{"127.0.0.1:9"}, SessionTimeout: 365 * 24 * time.Hour}}, "Kafka.SessionTimeout 8760h0m0s: want less than 2^31 ms"},
		{saga.Config{Kafka: &saga.KafkaConfig{Brokers: []string{"127.0.0.1:9"}, SessionTimeout: math.MaxInt64}}, "Kafka.SessionTimeout 2562047h47m16.854775807s"},
	} {
		_, err := saga.New(dummyPool(t), &tc.cfg)
		require.ErrorIs(t, err, saga.ErrInvalidConfig)
		require.ErrorContains(t, err, tc.want)
	}
	_, err := saga.New(nil, nil)
	require.ErrorContains(t, err, "pool is nil")
	// A reader of its own (another transport) needs no brokers.
	_, err = saga.New(dummyPool(t), &saga.Config{Kafka: &saga.KafkaConfig{
		NewReader: func(string, []string) saga.KafkaReader { return nil }}})
	require.NoError(t, err)
}

func TestExponentialBackoff(t *testing.T) {
	t.Parallel()
	bo := saga.ExponentialBackoff(100*time.Millisecond, time.Second)
	for _, tc := range []struct {
		attempt int
		base    time.Duration
	}{{1, 100 * time.Millisecond}, {2, 200 * time.Millisecond}, {3, 400 * time.Millisecond}, {4, 800 * time.Millisecond}, {5, time.Second}, {50, time.Second}} {
		for range 20 {
			d := bo(tc.attempt)
			require.GreaterOrEqual(t, d, tc.base*8/10, "attempt %d", tc.attempt)
			require.LessOrEqual(t, d, tc.base*12/10, "attempt %d", tc.attempt)
		}
	}
}
