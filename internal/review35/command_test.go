package review35_test

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// hostileCommands are Remote.Command payloads by the order's ID.
var hostileCommands = map[string]func() (any, error){
	"1MB":            func() (any, error) { return map[string]string{"s": strings.Repeat("x", 1<<20)}, nil },
	"10MB":           func() (any, error) { return map[string]string{"s": strings.Repeat("y", 10<<20)}, nil },
	"chan":           func() (any, error) { return map[string]any{"c": make(chan int)}, nil },
	"nan":            func() (any, error) { return math.NaN(), nil },
	"bad raw":        func() (any, error) { return json.RawMessage(`{"s":`), nil },
	"raw bad utf8":   func() (any, error) { return json.RawMessage("{\"s\":\"\xff\xfe\"}"), nil },
	"nul":            func() (any, error) { return map[string]string{"s": "a\x00b"}, nil },
	"bad utf8":       func() (any, error) { return map[string]string{"s": "a\xffb\xc3"}, nil },
	"nil":            func() (any, error) { return nil, nil },
	"panic":          func() (any, error) { panic("command boom") },
	"permanent":      func() (any, error) { return nil, steps.Permanent(steps.WithCode("no_payload", errors.New("no"))) },
	"marshal panics": func() (any, error) { return panicky{}, nil },
}

// panicky panics when encoded.
type panicky struct{}

func (panicky) MarshalJSON() ([]byte, error) { panic("marshal boom") }

// TestHostileCommands: Commands that return 1 MB and 10 MB payloads,
// unencodable values (a channel, NaN, broken and invalid-UTF-8 raw JSON,
// a Marshaler that panics), NUL and invalid UTF-8 in strings, nil, a
// panic and a permanent error, all at once beside healthy sagas on one
// engine, relay and participant. Healthy sagas must complete promptly;
// every hostile saga must end (no panic, no saga stuck), with a charge
// that reached the participant at most once.
func TestHostileCommands(t *testing.T) {
	def := saga.Define("pay",
		saga.Step[order]{Name: "reserve", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "charge", Timeout: 3 * time.Second,
			Retry:           &saga.RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return 0 }},
			CompensateRetry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return 0 }},
			Remote: &saga.Remote[order]{
				Topic: svcTopic, Type: "svc.charge", CompensateType: "svc.refund",
				Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) {
					if f, ok := hostileCommands[o.ID]; ok {
						return f()
					}
					return o, nil
				},
				// The refund is always small, so that only the forward
				// command is hostile.
				CompensateCommand: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return "refund", nil },
			}},
		saga.Step[order]{Name: "ship", Action: noop})
	r := newRig(t, def, rigOpts{cfg: saga.Config{RescueInterval: time.Second, HandlerGrace: time.Second}})
	ids := map[string]uuid.UUID{}
	var healthy []uuid.UUID
	for name := range hostileCommands {
		ids[name] = r.start(t, order{ID: name})
		healthy = append(healthy, r.start(t, order{ID: "healthy " + name}))
	}
	begun := time.Now()
	for _, id := range healthy {
		in := waitEnded(t, r.e, id, 30*time.Second)
		if in.Status != saga.StatusCompleted {
			t.Errorf("a healthy saga beside hostile ones: %s\n%s", in.Status, timeline(in))
		}
	}
	t.Logf("healthy sagas completed within %v", time.Since(begun))
	for name, id := range ids {
		in := waitEnded(t, r.e, id, 40*time.Second)
		calls := r.callsOf(id, "svc.charge")
		var size int
		if len(calls) > 0 {
			size = len(calls[0].Command)
		}
		t.Logf("%-14s → %-11s charge calls %d (%d bytes) refunds %d, last error %.300v", name, in.Status, len(calls), size, len(r.callsOf(id, "svc.refund")), in.LastError)
		if len(calls) > 1 {
			t.Errorf("%s: charge reached the participant %d times", name, len(calls))
		}
		if in.Status == saga.StatusCompleted && len(calls) != 1 {
			t.Errorf("%s: completed without a charge", name)
		}
	}
}

// onReplyBehaviours are OnReply's behaviours by the order's ID.
var onReplyBehaviours = map[string]func(o *order, attempt int) error{
	"error": func(*order, int) error { return errors.New("transient apply error") },
	"error once": func(_ *order, n int) error {
		if n == 1 {
			return errors.New("transient once")
		}
		return nil
	},
	"permanent":   func(*order, int) error { return steps.Permanent(steps.WithCode("bad_reply", errors.New("no"))) },
	"retry after": func(*order, int) error { return steps.RetryAfter(time.Hour, errors.New("later")) },
	"panic":       func(*order, int) error { panic("on reply boom") },
	"huge state": func(o *order, _ int) error {
		o.Pad = strings.Repeat("z", 2<<20)
		return nil
	},
	"nul state": func(o *order, _ int) error {
		o.Got = "a\x00b"
		return nil
	},
}

// TestOnReplyErrorsAndPanics: OnReply returning a transient error (every
// time, and once), a permanent one, a RetryAfter, panicking, or leaving a
// state too large or one PostgreSQL refuses, all on one reply partition
// beside healthy sagas. The healthy ones must complete promptly; every
// other saga must end (or, for a transient error, go on), never stuck
// with the reply lost, and the next step must run at most once.
func TestOnReplyErrorsAndPanics(t *testing.T) {
	applied := newTally()
	fx := newEffects(t)
	def := saga.Define("pay",
		saga.Step[order]{Name: "reserve", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "charge", Timeout: 5 * time.Second,
			Retry:           &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return 0 }},
			CompensateRetry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return 0 }},
			Remote: chargeRemote(func(_ context.Context, run *saga.StepRun, o *order, res json.RawMessage) error {
				applied.add(run.SagaID)
				if f, ok := onReplyBehaviours[o.ID]; ok {
					return f(o, applied.of(run.SagaID))
				}
				o.Got = string(res)
				return nil
			})},
		saga.Step[order]{Name: "ship", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error { return fx.record(ctx, run) }})
	r := newRig(t, def, rigOpts{cfg: saga.Config{RescueInterval: time.Second}})
	ids := map[string]uuid.UUID{}
	var healthy []uuid.UUID
	for name := range onReplyBehaviours {
		ids[name] = r.start(t, order{ID: name})
		healthy = append(healthy, r.start(t, order{ID: "healthy " + name}))
	}
	begun := time.Now()
	for _, id := range healthy {
		in := waitEnded(t, r.e, id, 30*time.Second)
		if in.Status != saga.StatusCompleted {
			t.Errorf("a healthy saga beside bad OnReplies: %s\n%s", in.Status, timeline(in))
		}
	}
	t.Logf("healthy sagas completed within %v", time.Since(begun))
	for name, id := range ids {
		in := waitEnded(t, r.e, id, 40*time.Second)
		t.Logf("%-11s → %-11s OnReply ran %d, charge calls %d, refunds %d, ship %d, last error %.200v", name, in.Status, applied.of(id),
			len(r.callsOf(id, "svc.charge")), len(r.callsOf(id, "svc.refund")), fx.of(t, id, "ship/forward"), in.LastError)
		if n := fx.of(t, id, "ship/forward"); n > 1 || (in.Status == saga.StatusCompleted) != (n == 1) {
			t.Errorf("%s: %s with ship's effect %d times\n%s", name, in.Status, n, timeline(in))
		}
		if in.Status == saga.StatusCompleted && name != "error once" {
			t.Errorf("%s: completed although OnReply failed\n%s", name, timeline(in))
		}
	}
}

// TestTooLargeCommandFailsTheStepAtOnce (F1, fixed): a Command whose
// payload was larger than the relay's MaxMessageBytes (1 MiB by default)
// was parked as dead by the relay, and its saga, whose remote step has an
// hour's Timeout, waited an hour for a reply to a command that never left,
// then ended with "no reply" (reply_timeout). Config.MaxCommandBytes now
// refuses it before the outbox, with a clear, coded error (README "Bad
// input is parked ... get a clear, coded error").
func TestTooLargeCommandFailsTheStepAtOnce(t *testing.T) {
	def := saga.Define("pay",
		saga.Step[order]{Name: "reserve", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "charge", Timeout: time.Hour, Remote: &saga.Remote[order]{
			Topic: svcTopic, Type: "svc.charge", CompensateType: "svc.refund",
			Command: func(context.Context, *saga.StepRun, *order) (any, error) {
				return map[string]string{"s": strings.Repeat("x", 1<<20)}, nil
			},
			CompensateCommand: func(context.Context, *saga.StepRun, *order) (any, error) { return "refund", nil },
		}},
		saga.Step[order]{Name: "ship", Action: noop})
	r := newRig(t, def, rigOpts{cfg: saga.Config{RescueInterval: time.Second}})
	id := r.start(t, order{ID: "big"})
	// F1, fixed: the command is refused before it reaches the outbox, with
	// a coded error naming its size, and the saga compensates at once
	// instead of waiting its Timeout (an hour) for a reply.
	deadline := time.Now().Add(20 * time.Second)
	var in *saga.Instance
	for time.Now().Before(deadline) {
		if in = get(t, r.e, id); in.Status.Terminal() {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("%s at %s, last error %+v\n%s", in.Status, in.Step, in.LastError, timeline(in))
	if in.Status != saga.StatusCompensated {
		t.Fatalf("the saga is %s at %s, want compensated at once", in.Status, in.Step)
	}
	if in.LastError == nil || in.LastError.Code != saga.CodeTooLarge || !strings.Contains(in.LastError.Message, "MaxCommandBytes") {
		t.Errorf("last error %+v, want %s naming MaxCommandBytes", in.LastError, saga.CodeTooLarge)
	}
	page, err := r.e.DeadMessages(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range page.Messages {
		if m.SagaID != nil && *m.SagaID == id {
			t.Errorf("a command of the saga was parked: %.200s", m.LastError)
		}
	}
}

// TestOnReplyErrorFailsTheStepForGood (F2, settled by the doc): package
// steps says "Any other error is retried with the step's retry policy";
// Remote.OnReply's doc said nothing of its errors, and an OnReply that
// failed once with a retryable error (the step's Retry allows 5 attempts)
// compensated the saga at once. The doc now says that any OnReply error
// fails the step for good; this holds it to that.
func TestOnReplyErrorFailsTheStepForGood(t *testing.T) {
	applied := newTally()
	def := saga.Define("pay",
		saga.Step[order]{Name: "reserve", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "charge", Timeout: 10 * time.Second,
			Retry: &saga.RetryPolicy{MaxAttempts: 5, Backoff: func(int) time.Duration { return 0 }},
			Remote: chargeRemote(func(_ context.Context, run *saga.StepRun, o *order, res json.RawMessage) error {
				applied.add(run.SagaID)
				if applied.of(run.SagaID) == 1 {
					return steps.RetryAfter(10*time.Millisecond, errors.New("the ledger is busy, try again"))
				}
				o.Got = string(res)
				return nil
			})},
		saga.Step[order]{Name: "ship", Action: noop})
	r := newRig(t, def, rigOpts{cfg: saga.Config{RescueInterval: time.Second}})
	id := r.start(t, order{ID: "once"})
	in := waitEnded(t, r.e, id, 30*time.Second)
	t.Logf("%s, OnReply ran %d, refunds %d, last error %+v", in.Status, applied.of(id), len(r.callsOf(id, "svc.refund")), in.LastError)
	// F2, settled by the doc: Remote.OnReply now says that any error it
	// returns fails the step for good. The saga compensates, OnReply ran
	// once, and the charge is refunded once.
	if in.Status != saga.StatusCompensated || applied.of(id) != 1 || len(r.callsOf(id, "svc.refund")) != 1 {
		t.Errorf("%s, OnReply ran %d times, %d refunds; want compensated, once, one refund\n%s",
			in.Status, applied.of(id), len(r.callsOf(id, "svc.refund")), timeline(in))
	}
}
