package inbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/health"
	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
)

// A consumer whose reader's group session timeout the broker refuses (2 s,
// below the 6 s the broker accepts) consumes nothing, for ever: its health
// is then not ready, and its fetch check names the broker's refusal, so a
// readiness probe shows what an operator must change. A participant runs
// on such a consumer and reports the same.
func TestKafkaConsumerHealthShowsARefusedSessionTimeout(t *testing.T) {
	t.Parallel()
	b := setup(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, kafkaTopic))
	produce(t, kc, kafkaMessage("charge.requested", "m-1", []byte(`{}`)))
	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers: kc.Addrs(), GroupID: kafkaGroup, Topic: kafkaTopic, StartOffset: kafka.FirstOffset,
		SessionTimeout: 2 * time.Second, JoinGroupBackoff: 200 * time.Millisecond, MaxWait: 50 * time.Millisecond,
	})
	t.Cleanup(func() { _ = r.Close() })
	c, err := b.in.NewConsumer(r, &inbox.ConsumerConfig{Default: func(context.Context, pgx.Tx, inbox.Message) error { return nil }})
	require.NoError(t, err)
	ctx := context.Background()
	rep := c.Health(ctx)
	require.Equal(t, "fetch", rep.Checks[2].Name)
	require.True(t, rep.Checks[2].OK, "before any fetch: %+v", rep)
	require.NoError(t, c.Start(ctx))
	t.Cleanup(func() { _ = c.Stop(ctx) })

	var fetch health.Check
	deadline := time.Now().Add(20 * time.Second)
	for {
		rep = c.Health(ctx)
		fetch = rep.Checks[2]
		if !fetch.OK || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	require.False(t, fetch.OK, "after 20 s the fetch check still passes: %+v", rep)
	require.False(t, rep.Ready)
	require.True(t, rep.Live, "restarting would not help; the setting must change")
	require.True(t, strings.Contains(fetch.Detail, "Invalid Session Timeout"), "the detail names the refusal: %q", fetch.Detail)
	require.Zero(t, b.count(t, "SELECT count(*) FROM "+b.table("inbox")), "nothing was consumed")
}
