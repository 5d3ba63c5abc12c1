package saga

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
)

// A Kafka-mode engine's kafka check is not OK while its fetches fail (a
// session timeout the broker refuses: review31 F4), with the error, and OK
// again once a fetch brings a message (internal/consume tests that a
// failure that stopped lets it go too). An engine that reads no Kafka has
// no such check.
func TestKafkaHealthCheckFollowsTheFetches(t *testing.T) {
	t.Parallel()
	pool, schema := pgtest.Migrated(t)
	e, err := New(pool, &Config{Schema: schema, Kafka: &KafkaConfig{Brokers: []string{"127.0.0.1:9"}, AllSteps: true}})
	require.NoError(t, err)
	require.NoError(t, e.Register(Define("health-kafka", Step[noState]{Name: "a", Action: noop})))
	ctx := context.Background()
	check := func() (bool, string) {
		for _, c := range e.Health(ctx).Checks {
			if c.Name == "kafka" {
				return c.OK, c.Detail
			}
		}
		t.Fatal("no kafka check")
		return false, ""
	}
	ok, detail := check()
	require.True(t, ok, detail)

	e.hstate.fetches.Fetched(errors.New("[26] Invalid Session Timeout"))
	ok, detail = check()
	require.False(t, ok)
	require.Contains(t, detail, "Invalid Session Timeout")

	e.hstate.fetches.Fetched(nil)
	ok, _ = check()
	require.True(t, ok)

	local, err := New(pool, &Config{Schema: schema})
	require.NoError(t, err)
	for _, c := range local.Health(ctx).Checks {
		require.NotEqual(t, "kafka", c.Name)
	}
}
