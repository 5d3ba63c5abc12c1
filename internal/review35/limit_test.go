package review35_test

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// shipAfterCharge is "pay": reserve (local), charge (remote, refund
// compensates remotely), ship (local: sleeps slow when the order's Pad
// says "slow", honouring ctx, then records its effect in its
// transaction).
func shipAfterCharge(fx *effects, slow time.Duration, chargeTimeout time.Duration) *saga.Definition[order] {
	return saga.Define("pay",
		saga.Step[order]{Name: "reserve", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "charge", Timeout: chargeTimeout, Remote: chargeRemote(nil)},
		saga.Step[order]{Name: "ship", Timeout: 20 * time.Second, Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
			if o.Pad == "slow" {
				select {
				case <-time.After(slow):
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			return fx.record(ctx, run)
		}})
}

// TestReplyStepLimitExtremes: ReplyStepLimit 0 (the default, 200 ms),
// negative, 1 ns, 1 µs and the largest duration, each with five quick sagas and one
// slow (700 ms) local step after the remote one. Every saga must complete
// with each effect once; the slow step is handed to a worker exactly when
// the limit is positive and shorter than it.
func TestReplyStepLimitExtremes(t *testing.T) {
	const slow = 700 * time.Millisecond
	cases := []struct {
		name    string
		limit   time.Duration
		handoff bool // the slow step must be handed off
	}{
		{"zero is the default", 0, true},
		{"negative", -1, false},
		{"one ns", time.Nanosecond, true},
		{"one us", time.Microsecond, true},
		{"largest", math.MaxInt64, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			fx := newEffects(t)
			def := shipAfterCharge(fx, slow, time.Minute)
			r := newRig(t, def, rigOpts{cfg: saga.Config{Kafka: &saga.KafkaConfig{ReplyStepLimit: c.limit}}})
			ids := []uuid.UUID{r.start(t, order{ID: "slow", Pad: "slow"})}
			for i := 0; i < 5; i++ {
				ids = append(ids, r.start(t, order{ID: "quick"}))
			}
			for _, id := range ids {
				in := waitEnded(t, r.e, id, 40*time.Second)
				if in.Status != saga.StatusCompleted {
					t.Fatalf("saga %s: %s\n%s", in.ID, in.Status, timeline(in))
				}
				if n := fx.of(t, in.ID, "ship/forward"); n != 1 {
					t.Errorf("saga %s: ship's effect committed %d times\n%s", in.ID, n, timeline(in))
				}
				if n := len(r.callsOf(in.ID, "svc.charge")); n != 1 {
					t.Errorf("saga %s: charge called %d times", in.ID, n)
				}
				if n := count(in, "step_completed", "ship"); n != 1 {
					t.Errorf("saga %s: ship completed %d times in the timeline\n%s", in.ID, n, timeline(in))
				}
				if n := count(in, "step_failed", "ship"); n != 0 {
					t.Errorf("saga %s: a handed-off step was recorded as failed %d times\n%s", in.ID, n, timeline(in))
				}
			}
			st := r.e.Stats()
			t.Logf("limit %v: handed off %d, chained %d", c.limit, st.StepsHandedOff, st.Chained)
			if c.handoff && st.StepsHandedOff == 0 {
				t.Errorf("limit %v: a %v step after a reply was not handed off", c.limit, slow)
			}
			if !c.handoff && st.StepsHandedOff != 0 {
				t.Errorf("limit %v: %d steps handed off, want none", c.limit, st.StepsHandedOff)
			}
		})
	}
}

// TestReplyStepLimitWithAStepThatIgnoresItsContext: the step after the
// reply sleeps 800 ms ignoring its ctx, then writes its effect in its
// transaction. Past a limit of 1 ns, 1 µs or the default, the given-up
// run's connection is closed (its write must fail or be undone) and a
// worker runs the step again: the effect must commit exactly once, and
// a quick saga behind it on the same reply partition must not wait for
// the deaf step.
func TestReplyStepLimitWithAStepThatIgnoresItsContext(t *testing.T) {
	for _, limit := range []time.Duration{time.Nanosecond, time.Microsecond, 0} {
		t.Run(limit.String(), func(t *testing.T) {
			fx := newEffects(t)
			runs := newTally()
			def := saga.Define("pay",
				saga.Step[order]{Name: "reserve", Action: noop, Compensate: noop},
				saga.Step[order]{Name: "charge", Timeout: time.Minute, Remote: chargeRemote(nil)},
				saga.Step[order]{Name: "ship", Timeout: 20 * time.Second, Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
					runs.add(run.SagaID)
					if o.Pad == "deaf" {
						time.Sleep(800 * time.Millisecond) // ignores ctx
					}
					return fx.record(context.WithoutCancel(ctx), run)
				}})
			r := newRig(t, def, rigOpts{cfg: saga.Config{Kafka: &saga.KafkaConfig{ReplyStepLimit: limit}, HandlerGrace: 3 * time.Second}})
			deaf := r.start(t, order{ID: "deaf", Pad: "deaf"})
			quick := r.start(t, order{ID: "quick"})
			inQ := waitEnded(t, r.e, quick, 30*time.Second)
			inD := waitEnded(t, r.e, deaf, 40*time.Second)
			for _, in := range []*saga.Instance{inQ, inD} {
				if in.Status != saga.StatusCompleted {
					t.Fatalf("%s\n%s", in.Status, timeline(in))
				}
				if n := fx.of(t, in.ID, "ship/forward"); n != 1 {
					t.Errorf("saga %s: ship's effect committed %d times (ran %d times)\n%s", in.ID, n, runs.of(in.ID), timeline(in))
				}
			}
			t.Logf("deaf ship ran %d times, handed off %d", runs.of(deaf), r.e.Stats().StepsHandedOff)
		})
	}
}

// TestReplyStepLimitBeforeASlowRemoteCommand: after charge's reply the
// next step is remote too (notify), whose Command takes 500 ms (honouring
// ctx). Past a limit of 1 ns, or the default, the Command is given up and
// sent by a worker: notify must reach the participant exactly once and
// the saga complete; with a negative limit it is sent from the reply
// worker.
func TestReplyStepLimitBeforeASlowRemoteCommand(t *testing.T) {
	for _, limit := range []time.Duration{time.Nanosecond, 0, -1} {
		t.Run(limit.String(), func(t *testing.T) {
			built := newTally()
			def := saga.Define("pay",
				saga.Step[order]{Name: "reserve", Action: noop, Compensate: noop},
				saga.Step[order]{Name: "charge", Timeout: time.Minute, Remote: chargeRemote(nil)},
				saga.Step[order]{Name: "notify", Timeout: time.Minute, Remote: &saga.Remote[order]{
					Topic: svcTopic, Type: "svc.notify",
					Command: func(ctx context.Context, run *saga.StepRun, o *order) (any, error) {
						built.add(run.SagaID)
						select {
						case <-time.After(500 * time.Millisecond):
						case <-ctx.Done():
							return nil, ctx.Err()
						}
						return o, nil
					},
				}},
				saga.Step[order]{Name: "ship", Action: noop})
			r := newRig(t, def, rigOpts{
				cfg: saga.Config{Kafka: &saga.KafkaConfig{ReplyStepLimit: limit}},
				answers: map[string]sagatest.Answer{
					"svc.charge": sagatest.Reply("ok"), "svc.refund": sagatest.Reply("refunded"), "svc.notify": sagatest.Reply("sent"),
				},
			})
			id := r.start(t, order{ID: "notify"})
			in := waitEnded(t, r.e, id, 40*time.Second)
			t.Logf("Command built %d times, handed off %d", built.of(id), r.e.Stats().StepsHandedOff)
			if in.Status != saga.StatusCompleted {
				t.Fatalf("%s\n%s", in.Status, timeline(in))
			}
			if n := len(r.callsOf(id, "svc.notify")); n != 1 {
				t.Errorf("notify reached the participant %d times", n)
			}
			if n := count(in, "command_sent", "notify"); n != 1 {
				t.Errorf("notify sent %d times in the timeline\n%s", n, timeline(in))
			}
		})
	}
}
