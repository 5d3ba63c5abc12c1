package review35_test

import (
	"context"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// refundSends counts the refund commands for saga id that reached the
// participant's topic (a command sent again under the same key is
// deduplicated by the participant, so Calls would not show it).
func (r *rig) refundSends(t *testing.T, id uuid.UUID) int {
	t.Helper()
	msgs, err := r.kc.ReadAll(ctxT(t, 20*time.Second), svcTopic)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, m := range msgs {
		if string(m.Key) != id.String() {
			continue
		}
		for _, h := range m.Headers {
			if h.Key == "sagaflow-type" && string(h.Value) == "svc.refund" {
				n++
			}
		}
	}
	return n
}

// deafCompensation is "pay" whose charge and refund are never answered:
// charge times out after timeout, and its refund is sent again per
// policy.
func deafCompensation(t *testing.T, timeout time.Duration, policy *saga.RetryPolicy) *rig {
	t.Helper()
	def := saga.Define("pay",
		saga.Step[order]{Name: "reserve", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "charge", Timeout: timeout, CompensateRetry: policy, Remote: chargeRemote(nil)},
		saga.Step[order]{Name: "ship", Action: noop})
	return newRig(t, def, rigOpts{
		cfg:       saga.Config{RescueInterval: time.Second},
		answers:   map[string]sagatest.Answer{"svc.charge": sagatest.NoReply(), "svc.refund": sagatest.NoReply()},
		mayRefuse: true,
	})
}

// rescueUntil runs the rescuer every 200 ms until cond holds.
func rescueUntil(t *testing.T, e *saga.Engine, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", d, what)
		}
		_, _ = e.RescueNow(context.Background())
		time.Sleep(200 * time.Millisecond)
	}
}

// TestRemoteCompensateRetryExtremes: a remote compensation that is never
// answered, with CompensateRetry of 1 attempt, 0 (the default, 5), 3 attempts with a negative
// backoff (due at once), and a negative MaxAttempts (refused by Register,
// as RetryPolicy says). The refund is sent exactly MaxAttempts times, then
// the saga ends failed.
func TestRemoteCompensateRetryExtremes(t *testing.T) {
	cases := []struct {
		name   string
		policy *saga.RetryPolicy
		sends  int // 0: must be refused
	}{
		{"one attempt", &saga.RetryPolicy{MaxAttempts: 1, Backoff: func(int) time.Duration { return 0 }}, 1},
		{"three attempts negative backoff", &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return -time.Hour }}, 3},
		{"zero attempts is the default", &saga.RetryPolicy{MaxAttempts: 0, Backoff: func(int) time.Duration { return 0 }}, saga.MaxAttemptsDefault},
		{"negative attempts", &saga.RetryPolicy{MaxAttempts: -1}, 0},
		{"min int attempts", &saga.RetryPolicy{MaxAttempts: math.MinInt}, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := deafCompensation(t, 300*time.Millisecond, c.policy)
			if c.sends == 0 {
				if r.regErr == nil {
					t.Fatalf("Register accepted MaxAttempts %d", c.policy.MaxAttempts)
				}
				if !strings.Contains(r.regErr.Error(), "MaxAttempts") {
					t.Errorf("the refusal does not name MaxAttempts: %v", r.regErr)
				}
				return
			}
			if r.regErr != nil {
				t.Fatal(r.regErr)
			}
			id := r.start(t, order{ID: c.name})
			in := waitEnded(t, r.e, id, 45*time.Second)
			if in.Status != saga.StatusFailed {
				t.Fatalf("%s\n%s", in.Status, timeline(in))
			}
			// Let any send the end raced with reach the topic.
			time.Sleep(500 * time.Millisecond)
			if n := r.refundSends(t, id); n != c.sends {
				t.Errorf("refund sent %d times, want %d\n%s", n, c.sends, timeline(in))
			}
			t.Logf("failed: %+v", in.LastError)
		})
	}
}

// TestRemoteCompensationRetriedWithoutLimitThenAnswered: CompensateRetry
// with MaxAttempts math.MaxInt and no backoff: the refund is sent again
// and again while the saga compensates (never failed), and a late reply to
// it ends the saga compensated.
func TestRemoteCompensationRetriedWithoutLimitThenAnswered(t *testing.T) {
	r := deafCompensation(t, 300*time.Millisecond, &saga.RetryPolicy{MaxAttempts: math.MaxInt, Backoff: func(int) time.Duration { return 0 }})
	if r.regErr != nil {
		t.Fatal(r.regErr)
	}
	id := r.start(t, order{ID: "many"})
	rescueUntil(t, r.e, 40*time.Second, "three refund sends", func() bool { return r.refundSends(t, id) >= 3 })
	in := get(t, r.e, id)
	if in.Status != saga.StatusCompensating {
		t.Fatalf("%s\n%s", in.Status, timeline(in))
	}
	r.send(t, forgedReply(id, "charge", "compensate", "", `{"ok":true,"result":"refunded"}`))
	in = waitEnded(t, r.e, id, 20*time.Second)
	if in.Status != saga.StatusCompensated {
		t.Fatalf("%s\n%s", in.Status, timeline(in))
	}
	if n := count(in, "compensation_completed", "charge"); n != 1 {
		t.Errorf("charge compensated %d times\n%s", n, timeline(in))
	}
}

// TestRemoteCompensationHugeBackoff: the refund's retry is due in the
// largest duration: the saga must keep compensating (no overflow into
// the past, no failure, no second send). A reply to the first refund that
// comes during the backoff is not awaited any more and is dropped (the
// saga waits for the next send, as documented); the saga stays
// compensating.
func TestRemoteCompensationHugeBackoff(t *testing.T) {
	r := deafCompensation(t, 300*time.Millisecond, &saga.RetryPolicy{MaxAttempts: 5, Backoff: func(int) time.Duration { return math.MaxInt64 }})
	if r.regErr != nil {
		t.Fatal(r.regErr)
	}
	id := r.start(t, order{ID: "huge backoff"})
	rescueUntil(t, r.e, 30*time.Second, "the refund's first timeout", func() bool {
		in := get(t, r.e, id)
		return in.Status != saga.StatusRunning && (in.Attempt >= 1 || in.Status.Terminal())
	})
	for i := 0; i < 3; i++ {
		_, _ = r.e.RescueNow(ctxT(t, 10*time.Second))
		time.Sleep(300 * time.Millisecond)
	}
	in := get(t, r.e, id)
	t.Logf("%s at %s/%s attempt %d, next check %v", in.Status, in.Step, in.Direction, in.Attempt, in.NextCheckAt)
	if in.Status != saga.StatusCompensating {
		t.Fatalf("%s\n%s", in.Status, timeline(in))
	}
	if in.NextCheckAt == nil || in.NextCheckAt.Before(time.Now().Add(100*365*24*time.Hour)) {
		t.Errorf("the next check of a 292-year backoff is %v", in.NextCheckAt)
	}
	if n := r.refundSends(t, id); n != 1 {
		t.Errorf("refund sent %d times within a second of a 292-year backoff", n)
	}
	r.send(t, forgedReply(id, "charge", "compensate", "", `{"ok":true,"result":"refunded"}`))
	time.Sleep(1500 * time.Millisecond)
	if in := get(t, r.e, id); in.Status != saga.StatusCompensating {
		t.Errorf("%s\n%s", in.Status, timeline(in))
	}
}

// TestLateRefundReplyIsSentAgain: with the real participant, a refund
// answered after its Timeout (its reply lands in the backoff and is
// dropped) is sent again under the same key; the participant does not
// run it again but sends its reply again, and the saga ends compensated
// with the refund done once.
func TestLateRefundReplyIsSentAgain(t *testing.T) {
	runs := newTally()
	def := saga.Define("pay",
		saga.Step[order]{Name: "reserve", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "charge", Timeout: 500 * time.Millisecond,
			CompensateRetry: &saga.RetryPolicy{MaxAttempts: 6, Backoff: func(int) time.Duration { return time.Second }},
			Remote:          chargeRemote(nil)},
		saga.Step[order]{Name: "ship", Action: noop})
	r := newRig(t, def, rigOpts{
		cfg: saga.Config{RescueInterval: time.Second},
		answers: map[string]sagatest.Answer{
			"svc.charge": sagatest.NoReply(),
			"svc.refund": sagatest.AnswerFunc(func(ctx context.Context, c sagatest.Call) (any, error) {
				runs.add(c.Key.SagaID)
				time.Sleep(1500 * time.Millisecond)
				return "refunded", nil
			}),
		},
	})
	id := r.start(t, order{ID: "late refund"})
	in := waitEnded(t, r.e, id, 45*time.Second)
	t.Logf("refund sends %d\n%s", r.refundSends(t, id), timeline(in))
	if in.Status != saga.StatusCompensated {
		t.Fatalf("%s\n%s", in.Status, timeline(in))
	}
	if n := runs.of(id); n != 1 {
		t.Errorf("the refund ran %d times at the participant", n)
	}
}
