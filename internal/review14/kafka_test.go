package review14

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// newKafkaRig is newRig with an in-process Kafka cluster holding the
// command topic of saga name (two partitions) and a relay on the schema.
func newKafkaRig(t *testing.T, name string) (*rig, *kafkatest.Cluster) {
	t.Helper()
	kc := kafkatest.New(t, kafkatest.SeedTopics(2, saga.CommandTopicDefault+"."+name))
	r := newRig(t)
	testkit.Relay(t, kc.Addrs(), r.db)
	return r, kc
}

// kafkaDef: nap (100 ms timer) -> act -> await (OnSignal "go") -> act2
// (Timeout 300 ms), with act(tag, o, n) deciding what act and act2 do on
// their nth run.
func kafkaDef(r *rig, name string, acts *tally, do func(tag string, o *ord, n int) error) *saga.Definition[ord] {
	step := func(tag string) saga.StepFunc[ord] {
		return func(ctx context.Context, run *saga.StepRun, o *ord) error {
			if err := do(tag, o, acts.add(o.ID+"/"+tag)); err != nil {
				return err
			}
			return r.fx.Record(context.WithoutCancel(ctx), run, tag)
		}
	}
	return saga.Define(name,
		saga.Step[ord]{Name: "nap", Wait: saga.Sleep[ord](100 * time.Millisecond)},
		saga.Step[ord]{Name: "act", Action: step("act"), Retry: noBackoff(3), Timeout: 300 * time.Millisecond, Compensate: rec(r, "unact")},
		saga.Step[ord]{Name: "await", Compensate: rec(r, "unawait"),
			Wait: saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, s *ord, p string) error {
				s.Got = p
				return r.fx.Record(ctx, run, "onsig")
			})},
		saga.Step[ord]{Name: "act2", Action: step("act2"), Retry: noBackoff(3), Timeout: 300 * time.Millisecond},
	)
}

func kafkaConfig(kc *kafkatest.Cluster) func(*saga.Config) {
	return func(c *saga.Config) {
		c.Workers = 2
		c.BatchSize = 8
		c.HandlerGrace = 300 * time.Millisecond
		c.Kafka = &saga.KafkaConfig{Brokers: kc.Addrs(), AllSteps: true, SessionTimeout: 6 * time.Second}
	}
}

// Kafka mode (every step command over the bus, several messages to a
// transaction): a timer, then a local step; a signal, then a local step.
// One saga's step chained after its timer panics once, another's step
// chained after its signal fails for good: every effect is there as
// often as its step completed, each wait ended once.
func TestKafkaModeWaitsThenLocalSteps(t *testing.T) {
	t.Parallel()
	const name = "kmode"
	r, kc := newKafkaRig(t, name)
	var acts tally
	def := kafkaDef(r, name, &acts, func(tag string, o *ord, n int) error {
		switch {
		case o.ID == "panic" && tag == "act" && n == 1:
			panic("first act panics")
		case o.ID == "perm" && tag == "act2":
			return steps.Permanent(errors.New("no"))
		}
		return nil
	})
	r.start(t, kafkaConfig(kc), def)
	ctx := context.Background()
	names := []string{"panic", "perm"}
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
		r.waiting(t, ids[n], "await")
	}
	for _, n := range names {
		r.signal(t, ids[n], "go", "s-"+n, n)
	}
	for _, n := range names {
		in := r.ended(t, ids[n])
		id := ids[n]
		require.Equal(t, 1, count(in, "timer_fired:nap"), "%s\n%s", n, describe(in))
		require.Equal(t, 1, count(in, "signal_received:await"), "%s\n%s", n, describe(in))
		require.Equal(t, 1, r.fx.Count(t, id, "onsig"), n)
		require.Equal(t, 1, r.fx.Count(t, id, "act"), n)
		requireDelivered(t, r, id, "await")
		require.Equal(t, count(in, "step_completed:act2"), r.fx.Count(t, id, "act2"), "%s\n%s", n, describe(in))
		if n == "perm" {
			require.Equal(t, saga.StatusCompensated, in.Status, describe(in))
			require.Equal(t, []string{"act", "onsig", "unawait", "unact"}, r.fx.List(t, id))
			continue
		}
		require.Equal(t, saga.StatusCompleted, in.Status, "%s\n%s", n, describe(in))
		require.Equal(t, []string{"act", "onsig", "act2"}, r.fx.List(t, id), n)
		if n == "panic" {
			require.Equal(t, 1, count(in, "step_failed:act"), describe(in))
		}
	}
	require.Positive(t, r.engine.Stats().Chained)
}

// F2 (fixed in the engine after this review; this test asserts the fix).
// Kafka mode: the step chained after a signal (or a timer)
// ignores its context past Timeout + HandlerGrace once. KafkaConfig's doc:
// "if any of them cannot run now (its saga is busy, it is poison, a
// handler overran), nothing of the batch is committed and they run one at
// a time, each step once more". The sagas batched with it are run again;
// the overrunning saga's own message (its wake-up, or its timer's
// command) is not: the attempt is recorded as superseded and the saga
// waits on at its wait, its signal pending, until the rescuer finds the
// wake-up lost (RescueSlack, 1 min by default, then RescueInterval). The
// Postgres-only mode runs it again at once
// (TestDeafChainedStepIsAbandonedWithoutLosingTheWaitsEnd).
func TestKafkaModeDeafChainedStepKeepsTheWaitsEnd(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"wake", "early", "timer"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			name := "kdeaf" + kind
			r, kc := newKafkaRig(t, name)
			var acts tally
			sleepers := newSleepers(t, 3)
			deafTag := "act2" // chained after the signal
			if kind == "timer" {
				deafTag = "act" // chained after the timer
			}
			def := kafkaDef(r, name, &acts, func(tag string, o *ord, n int) error {
				if strings.HasPrefix(o.ID, "deaf") && tag == deafTag && n == 1 {
					defer sleepers.done()
					time.Sleep(1500 * time.Millisecond) // deaf to ctx
				}
				return nil
			})
			r.start(t, kafkaConfig(kc), def)
			ctx := context.Background()
			names := []string{"deaf-0", "h-0", "deaf-1", "h-1", "deaf-2", "h-2"}
			ids := map[string]uuid.UUID{}
			for _, n := range names {
				st, err := saga.Start(ctx, r.engine, def, ord{ID: n}, nil)
				require.NoError(t, err)
				ids[n] = st.ID
			}
			if kind == "wake" { // the signals wake the waits; else they are kept until the sagas reach them
				for _, n := range names {
					r.waiting(t, ids[n], "await")
				}
			}
			for _, n := range names {
				r.signal(t, ids[n], "go", "s-"+n, n)
			}
			for _, n := range names {
				// Well within RescueSlack (1 min) and RescueInterval (30 s).
				in := sagatest.WaitEnded(t, r.engine, ids[n], &sagatest.WaitOpts{Timeout: 15 * time.Second})
				require.Equal(t, saga.StatusCompleted, in.Status, "%s\n%s", n, describe(in))
				require.Equal(t, []string{"act", "onsig", "act2"}, r.fx.List(t, in.ID), n)
				require.Equal(t, 1, count(in, "timer_fired:nap"), "%s\n%s", n, describe(in))
				require.Equal(t, 1, count(in, "signal_received:await"), "%s\n%s", n, describe(in))
				requireDelivered(t, r, in.ID, "await")
			}
			require.Equal(t, int64(3), r.engine.Stats().HandlersAbandoned)
		})
	}
}

// Control for F2: in Kafka mode, a step that is not chained after a wait
// (it follows a local step, so it has a command of its own) and ignores
// its context past Timeout + HandlerGrace once is abandoned, recorded and
// retried at once, as the docs say.
func TestKafkaModeDeafPlainStepIsRetried(t *testing.T) {
	t.Parallel()
	const name = "kplain"
	r, kc := newKafkaRig(t, name)
	sleepers := newSleepers(t, 1)
	var acts tally
	def := saga.Define(name,
		saga.Step[ord]{Name: "first", Action: rec(r, "first")},
		saga.Step[ord]{Name: "plain", Timeout: 300 * time.Millisecond, Retry: noBackoff(3),
			Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
				if acts.add(o.ID) == 1 && o.ID == "deaf" {
					defer sleepers.done()
					time.Sleep(1500 * time.Millisecond) // deaf to ctx
				}
				return r.fx.Record(context.WithoutCancel(ctx), run, "plain")
			}},
	)
	r.start(t, kafkaConfig(kc), def)
	ids := map[string]uuid.UUID{}
	for _, n := range []string{"deaf", "h-0", "h-1", "h-2"} {
		st, err := saga.Start(context.Background(), r.engine, def, ord{ID: n}, nil)
		require.NoError(t, err)
		ids[n] = st.ID
	}
	for n, id := range ids {
		in := sagatest.WaitEnded(t, r.engine, id, &sagatest.WaitOpts{Timeout: 15 * time.Second})
		require.Equal(t, saga.StatusCompleted, in.Status, "%s\n%s", n, describe(in))
		require.Equal(t, []string{"first", "plain"}, r.fx.List(t, id), n)
		if n == "deaf" {
			require.Equal(t, 1, count(in, "step_failed:plain"), describe(in))
			for _, e := range in.History {
				if e.Type == saga.EventStepFailed {
					require.Equal(t, saga.CodeAbandonedRunOn, e.ErrorCode, describe(in))
				}
			}
		}
	}
	require.Equal(t, int64(1), r.engine.Stats().HandlersAbandoned)
}
