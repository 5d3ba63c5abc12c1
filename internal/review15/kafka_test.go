package review15

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// Kafka mode (KafkaConfig.AllSteps, BatchSize 8): twelve sagas, of which
// "deaf" has a bill Command that ignores its ctx past Timeout +
// HandlerGrace on its first build (in pay's reply's transaction, in a
// batch of messages), and "perm" a bill Command that fails for good.
// 90579db: the reply's message "runs again" after the abandonment, and
// the step is then claimed on its own. Every healthy saga completes with
// each effect once (or, under load, times out on bill behind the deaf run
// and is undone exactly: F2); deaf completes (bill built twice, more only when
// a batch holding it is run again one message at a time; abandoned once,
// pay and bill charged once, "paid" once); perm compensates (pay refunded).
func TestKafkaModeRemoteAfterRemote(t *testing.T) {
	t.Parallel()
	const name = "kmode"
	r := newRig(t, name, nil)
	require.NoError(t, r.kc.CreateTopic(saga.CommandTopicDefault+"."+name, 2))
	var builds counter
	var sleepers testkit.Stragglers
	t.Cleanup(sleepers.Wait)
	r.billTime = time.Second
	r.billCmd = func(_ context.Context, _ *saga.StepRun, o *ord) (any, error) {
		n := builds.Add(o.ID)
		switch {
		case o.ID == "deaf" && n == 1:
			defer sleepers.Enter()()
			time.Sleep(2 * time.Second)
		case o.ID == "perm":
			return nil, steps.Permanent(errors.New("no"))
		}
		return cmd{ID: o.ID}, nil
	}
	def := r.def(3)
	r.start(t, func(c *saga.Config) {
		c.BatchSize = 8
		c.HandlerGrace = 200 * time.Millisecond
		c.Kafka = &saga.KafkaConfig{Brokers: r.kc.Addrs(), AllSteps: true, SessionTimeout: 6 * time.Second}
	}, def)
	ctx := context.Background()
	names := []string{"deaf", "perm"}
	for i := range 10 {
		names = append(names, fmt.Sprint("h-", i))
	}
	ids := map[string]uuid.UUID{}
	for _, n := range names {
		st, err := saga.Start(ctx, r.engine, def, ord{ID: n}, nil)
		require.NoError(t, err)
		ids[n] = st.ID
	}
	for _, n := range names {
		id := ids[n]
		in := r.ended(t, id)
		require.Equal(t, 1, r.fx.Count(t, id, "paid"), "%s: %v", n, timeline(in))
		require.Equal(t, 1, r.fx.Count(t, id, "pick"), "%s: %v", n, timeline(in))
		if n == "perm" {
			require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", timeline(in), in.LastError)
			testkit.WaitFor(t, wait, "pay refunded", func() bool { return len(r.calls(t, id)) == 2 })
			require.Equal(t, []string{"pay", "refund"}, r.calls(t, id))
			require.Zero(t, r.sent(t, id, "bill"))
			continue
		}
		// A healthy saga whose bill reply waited behind the deaf run may
		// time out (F2).
		r.completedOrTimedOut(t, n, in, n == "deaf")
		if n == "deaf" {
			// Built, abandoned, built again; once more each time a batch
			// holding its command is given up and run one message at a
			// time (a busy saga beside it, on a loaded machine): sent once
			// all the same (above).
			require.GreaterOrEqual(t, builds.Get(n), int32(2), "%v", timeline(in))
			require.LessOrEqual(t, int64(builds.Get(n)), 2+r.engine.Stats().BusBatchesRerun, "%v", timeline(in))
			require.Equal(t, []string{"bill"}, overran(in), "%v", timeline(in))
		}
	}
	require.Equal(t, int64(1), r.engine.Stats().HandlersAbandoned)
	require.Zero(t, r.orders.Count(t, "SELECT count(*) FROM "+r.orders.Table("dead_letters")))
}
