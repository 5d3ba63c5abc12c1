package review16

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// ReplyStepLimit's values are all accepted by New: negative (no limit),
// 1 ns, an hour, and in Kafka mode, where it does nothing. (No validation
// of the field is documented; none may refuse a value the doc gives a
// meaning.)
func TestReplyStepLimitValuesAreAccepted(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	for _, all := range []bool{false, true} {
		for _, v := range []time.Duration{-time.Hour, -1, 0, 1, time.Millisecond, time.Hour, 1<<63 - 1} {
			cfg := d.Config()
			cfg.Kafka = &saga.KafkaConfig{Brokers: []string{"127.0.0.1:1"}, AllSteps: all, ReplyStepLimit: v}
			_, err := saga.New(d.Pool, cfg)
			require.NoError(t, err, "AllSteps %v, ReplyStepLimit %v", all, v)
		}
	}
}

// ship takes 700 ms on every run (honouring ctx: it fails if cut). With
// ReplyStepLimit negative ("runs such steps to their Timeout on the reply
// worker") or an hour, it runs once, on the reply worker, never handed
// off; in Kafka mode ("no such limit") with a limit of 1 ns, the same.
func TestSlowShipIsNotCutWithoutALimit(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name  string
		limit time.Duration
		all   bool
	}{{"negative", -1, false}, {"hour", time.Hour, false}, {"kafkamode", 1, true}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r := newRig(t, "nolimit"+c.name, "", nil)
			if c.all {
				require.NoError(t, r.kc.CreateTopic(saga.CommandTopicDefault+"."+r.name, 1))
			}
			r.ship = func(ctx context.Context, run *saga.StepRun, o *ord, n int32) error {
				if waitCtx(ctx, 700*time.Millisecond) {
					return fmt.Errorf("cut: %w", ctx.Err())
				}
				return r.fx.Record(ctx, run, "ship")
			}
			def := r.def(defOpts{})
			r.start(t, func(cfg *saga.Config) { cfg.Kafka.ReplyStepLimit = c.limit; cfg.Kafka.AllSteps = c.all }, def)
			ids := startMany(t, r, def, []string{"a", "b", "c"})
			for n, id := range ids {
				in := r.ended(t, id)
				require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", timeline(in), in.LastError)
				require.Equal(t, int32(1), r.shipRuns.Get(n), "%s: %v", n, timeline(in))
				require.Equal(t, []string{"pick", "paid", "ship", "done"}, r.fx.List(t, id))
			}
			require.Zero(t, r.engine.Stats().StepsHandedOff)
			require.Zero(t, r.engine.Stats().AttemptsFailed)
		})
	}
}

// ReplyStepLimit 1 ns: every step after a reply is "still running then",
// so it is given up at once and handed off (and for a minute goes to a
// worker straight). Twenty sagas started at once, with a ship that writes
// through run.Tx and is fast: all complete, every effect exactly once, no
// attempt failed, at least one hand-off, at most one per saga.
func TestOneNanosecondLimit(t *testing.T) {
	t.Parallel()
	r := newRig(t, "onens", "", nil)
	def := r.def(defOpts{})
	r.start(t, func(cfg *saga.Config) { cfg.Kafka.ReplyStepLimit = 1 }, def)
	var names []string
	for i := range 20 {
		names = append(names, fmt.Sprint("n-", i))
	}
	ids := startMany(t, r, def, names)
	for n, id := range ids {
		in := r.ended(t, id)
		require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v %+v", n, timeline(in), in.LastError)
		require.Equal(t, []string{"pick", "paid", "ship", "done"}, r.fx.List(t, id), n)
		require.Zero(t, count(in, "step_failed", "ship"), "%v", timeline(in))
	}
	r.exactlyOnce(t)
	s := r.engine.Stats()
	require.GreaterOrEqual(t, s.StepsHandedOff, int64(1))
	require.LessOrEqual(t, s.StepsHandedOff, int64(20))
	require.Zero(t, s.AttemptsFailed)
}
