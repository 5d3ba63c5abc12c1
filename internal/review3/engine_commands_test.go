package review3_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/wire"
)

// Engine commands on the bus: every one of the engine's own commands
// delivered again has no second effect ("a step whose key is there is not run
// again"); a step command without a valid message id, or that does not
// decode, is dead-lettered; a forged one that is not the saga's current
// command has no effect.
func TestEngineCommandsDeliveredAgainAndForged(t *testing.T) {
	const topic = "sagaflow.commands.fg"
	pool, schema := migrated(t)
	table := effectsTable(t, pool, schema)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, topic))
	ctx := context.Background()
	write := func(ctx context.Context, run *saga.StepRun, o *order) error {
		_, err := run.Tx.Exec(ctx, "INSERT INTO "+table+" (saga_id, what) VALUES ($1, $2)", run.SagaID, run.Step)
		return err
	}
	def := saga.Define("fg", saga.Step[order]{Name: "a", Action: write}, saga.Step[order]{Name: "b", Action: write})
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	r, err := relay.New(pool, w, &relay.Config{Schema: schema})
	require.NoError(t, err)
	require.NoError(t, r.Start(ctx))
	e, err := saga.New(pool, &saga.Config{Schema: schema, PollInterval: 20 * time.Millisecond, Kafka: &saga.KafkaConfig{Brokers: kc.Addrs(), AllSteps: true}})
	require.NoError(t, err)
	require.NoError(t, e.Register(def))
	require.NoError(t, e.Start(ctx))
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = e.Stop(sctx)
		_ = r.Stop(sctx)
		_ = w.Close()
	})
	own := collect(t, kc, topic)
	prod := producer(t, kc)

	st, err := saga.Start(ctx, e, def, order{ID: "o-1"}, nil)
	require.NoError(t, err)
	in := sagatest.WaitEnded(t, e, st.ID, nil)
	require.Equal(t, saga.Status("completed"), in.Status)
	id := st.ID.String()
	eventually(t, 10*time.Second, func() bool { return len(own.with(wire.HeaderSagaID, id)) >= 2 }, "the engine's step commands")
	effects := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE saga_id = $1", st.ID).Scan(&n))
		return n
	}
	require.Equal(t, 2, effects())

	// Each of its own commands again, byte for byte, twice.
	var again []*kgo.Record
	for _, rec := range own.with(wire.HeaderSagaID, id) {
		c := &kgo.Record{Topic: topic, Key: rec.Key, Value: rec.Value, Headers: rec.Headers}
		again = append(again, c, c)
	}
	for _, c := range again {
		require.NoError(t, prod.ProduceSync(ctx, c).FirstErr())
	}

	// Forged step commands for the same saga.
	cmd := func(step string, version int) []byte {
		return []byte(`{"saga_id":"` + id + `","saga":"fg","step":"` + step + `","direction":"forward","epoch":0,"version":` + strconv.Itoa(version) + `}`)
	}
	stepHdrs := func(step string, withID bool) []hdr {
		hs := []hdr{{wire.HeaderType, wire.TypeStep}, {wire.HeaderSagaID, id}, {wire.HeaderStepKey, id + "/" + step + "/forward/0"}}
		if withID {
			hs = append(hs, hdr{wire.HeaderMessageID, newID()})
		}
		return hs
	}
	deadBefore := len(deadLetters(t, e))
	send(t, prod, topic, id, stepHdrs("a", false), cmd("a", 1))                                         // no message id: dead
	send(t, prod, topic, id, set(stepHdrs("a", true), wire.HeaderMessageID, "not-a-uuid"), cmd("a", 1)) // bad message id: dead
	send(t, prod, topic, id, stepHdrs("a", true), cmd(strings.Repeat("s", 10240), 1))                   // does not decode: dead
	send(t, prod, topic, id, stepHdrs("a", true), []byte(`{"saga_id":"`+id+`","saga":"fg","step":"a","direction":"forward","version":1,"extra":[1]}`))
	for v := 1; v <= 5; v++ {
		send(t, prod, topic, id, stepHdrs("a", true), cmd("a", v)) // not current: no effect
		send(t, prod, topic, id, stepHdrs("b", true), cmd("b", v))
	}

	// A marker behind them: a second saga must complete.
	st2, err := saga.Start(ctx, e, def, order{ID: "o-2"}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.Status("completed"), sagatest.WaitEnded(t, e, st2.ID, nil).Status)
	time.Sleep(300 * time.Millisecond)

	require.Equal(t, 2, effects(), "no command delivered again or forged ran a step again")
	in, err = e.Get(ctx, st.ID)
	require.NoError(t, err)
	require.Equal(t, saga.Status("completed"), in.Status)
	var reasons []string
	for _, l := range deadLetters(t, e)[deadBefore:] {
		reasons = append(reasons, l.Reason)
	}
	t.Logf("dead letters: %q", reasons)
	require.Len(t, reasons, 3, "the commands without a valid message id and the one that does not decode")
	for _, r := range reasons {
		require.True(t, strings.HasPrefix(r, "malformed_command"), r)
		require.Less(t, len(r), 500, "the reason quotes no more than a few bytes of the value")
	}
}
