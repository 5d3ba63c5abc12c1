package saga

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
)

// A Kafka-mode engine's kafka check is not OK while its fetches fail (a
// session timeout the broker refuses: review31 F4), with the error; a
// failure older than kafkaFailureFresh is one that stopped (a fetch that
// waits for a message reports nothing until one comes), and the check is
// OK again. An engine that reads no Kafka has no such check.
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

	e.hstate.fetched(errors.New("[26] Invalid Session Timeout"))
	ok, detail = check()
	require.False(t, ok)
	require.Contains(t, detail, "Invalid Session Timeout")

	e.hstate.mu.Lock()
	e.hstate.fetchAt = time.Now().Add(-kafkaFailureFresh - time.Second)
	e.hstate.mu.Unlock()
	ok, detail = check()
	require.True(t, ok, "a failure that stopped: %s", detail)

	e.hstate.fetched(nil)
	ok, _ = check()
	require.True(t, ok)

	local, err := New(pool, &Config{Schema: schema})
	require.NoError(t, err)
	for _, c := range local.Health(ctx).Checks {
		require.NotEqual(t, "kafka", c.Name)
	}
}
