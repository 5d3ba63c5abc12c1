package review35_test

import (
	"context"
	"encoding/json"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// forgedReply is a participant's reply as docs/protocol.md describes it,
// for saga id's step in direction dir at epoch 0.
func forgedReply(id uuid.UUID, step, dir, msgID, value string) kafka.Message {
	if msgID == "" {
		msgID = uuid.NewString()
	}
	return kafka.Message{Key: []byte(id.String()), Value: []byte(value), Headers: []kafka.Header{
		{Key: "sagaflow-message-id", Value: []byte(msgID)},
		{Key: "sagaflow-type", Value: []byte("sagaflow.reply")},
		{Key: "sagaflow-saga-id", Value: []byte(id.String())},
		{Key: "sagaflow-step-key", Value: []byte(id.String() + "/" + step + "/" + dir + "/0")},
	}}
}

func (r *rig) send(t *testing.T, msgs ...kafka.Message) {
	t.Helper()
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	w := &kafka.Writer{Addr: kafka.TCP(r.kc.Addrs()...), Topic: replyTopic, BatchTimeout: 5 * time.Millisecond, Transport: tr, RequiredAcks: kafka.RequireAll}
	defer w.Close()
	if err := w.WriteMessages(ctxT(t, 20*time.Second), msgs...); err != nil {
		t.Fatal(err)
	}
}

// deafRig is "pay" (reserve, charge remote with timeout, then
// extra steps) with a participant that never answers svc.charge (the
// test forges the replies) and answers svc.refund; OnReply runs are
// counted per saga.
type deafRig struct {
	*rig
	onReply *tally
	fx      *effects
}

func newDeafRig(t *testing.T, chargeTimeout time.Duration, cfg saga.Config, extra ...saga.Step[order]) *deafRig {
	t.Helper()
	d := &deafRig{onReply: newTally(), fx: newEffects(t)}
	stepsList := []saga.Step[order]{
		{Name: "reserve", Action: noop, Compensate: noop},
		{Name: "charge", Timeout: chargeTimeout, Remote: chargeRemote(func(_ context.Context, run *saga.StepRun, o *order, res json.RawMessage) error {
			d.onReply.add(run.SagaID)
			o.Got = string(res)
			return nil
		})},
	}
	stepsList = append(stepsList, extra...)
	stepsList = append(stepsList, saga.Step[order]{Name: "ship", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
		return d.fx.record(ctx, run)
	}})
	d.rig = newRig(t, saga.Define("pay", stepsList...), rigOpts{cfg: cfg, answers: map[string]sagatest.Answer{
		"svc.charge": sagatest.NoReply(), "svc.refund": sagatest.Reply("refunded"),
	}})
	return d
}

// waitSent waits until the participant has received saga id's charge.
func (d *deafRig) waitSent(t *testing.T, id uuid.UUID) {
	t.Helper()
	waitFor(t, 20*time.Second, "the charge command to reach the participant", func() bool {
		return len(d.callsOf(id, "svc.charge")) > 0
	})
}

// TestDuplicateRepliesApplyOnce: the same reply twice (one message id,
// a producer's retry) and a second reply of another message id, all in
// one produce request, while the saga waits, with the default
// ReplyStepLimit and with 1 ns before a slow step (handed off to a
// worker, the reply applied again on its own): the reply is applied once
// (charge completes once, the state holds the first copy's result), each
// later step's effect commits once, and the saga completes.
func TestDuplicateRepliesApplyOnce(t *testing.T) {
	for _, limit := range []time.Duration{0, time.Nanosecond} {
		t.Run(limit.String(), func(t *testing.T) {
			fx := newEffects(t)
			pack := saga.Step[order]{Name: "pack", Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
				select {
				case <-time.After(300 * time.Millisecond):
				case <-ctx.Done():
					return ctx.Err()
				}
				return fx.record(ctx, run)
			}}
			d := newDeafRig(t, time.Hour, saga.Config{Kafka: &saga.KafkaConfig{ReplyStepLimit: limit}}, pack)
			var ids []uuid.UUID
			for i := 0; i < 4; i++ {
				ids = append(ids, d.start(t, order{ID: "dup"}))
			}
			var msgs []kafka.Message
			for _, id := range ids {
				d.waitSent(t, id)
				mid := uuid.NewString()
				ok := `{"ok":true,"result":{"n":1}}`
				msgs = append(msgs, forgedReply(id, "charge", "forward", mid, ok), forgedReply(id, "charge", "forward", mid, ok),
					forgedReply(id, "charge", "forward", "", `{"ok":true,"result":{"n":2}}`))
			}
			d.send(t, msgs...)
			for _, id := range ids {
				in := waitEnded(t, d.e, id, 30*time.Second)
				if in.Status != saga.StatusCompleted {
					t.Fatalf("%s\n%s", in.Status, timeline(in))
				}
				var st order
				if err := in.DecodeState(&st); err != nil || st.Got != `{"n":1}` {
					t.Errorf("state Got %q (%v), want the first copy's result", st.Got, err)
				}
				if n := fx.of(t, id, "pack/forward") + d.fx.of(t, id, "ship/forward"); n != 2 {
					t.Errorf("pack and ship effects committed %d times, want 2", n)
				}
				if n := count(in, "step_completed", "charge"); n != 1 {
					t.Errorf("charge completed %d times\n%s", n, timeline(in))
				}
			}
			var runs []int
			for _, id := range ids {
				runs = append(runs, d.onReply.of(id))
			}
			t.Logf("OnReply runs %v, handed off %d", runs, d.e.Stats().StepsHandedOff)
		})
	}
}

// TestReplyForAStepTheSagaLeft: a saga past charge (waiting for a signal
// at hold) gets charge's reply again, a reply for hold (not remote), and a
// refusal of charge: none moves it, OnReply does not run again, and the
// signal still completes it.
func TestReplyForAStepTheSagaLeft(t *testing.T) {
	hold := saga.Step[order]{Name: "hold", Wait: saga.OnSignal("go", func(context.Context, *saga.StepRun, *order, json.RawMessage) error { return nil })}
	d := newDeafRig(t, time.Hour, saga.Config{}, hold)
	id := d.start(t, order{ID: "left"})
	d.waitSent(t, id)
	d.send(t, forgedReply(id, "charge", "forward", "", `{"ok":true,"result":"first"}`))
	waitFor(t, 20*time.Second, "the saga to reach hold", func() bool { return get(t, d.e, id).Step == "hold" })
	before := get(t, d.e, id)
	d.send(t,
		forgedReply(id, "charge", "forward", "", `{"ok":true,"result":"again"}`),
		forgedReply(id, "hold", "forward", "", `{"ok":true,"result":"hold"}`),
		forgedReply(id, "charge", "forward", "", `{"ok":false,"code":"late_refusal","error":"no"}`),
		forgedReply(id, "charge", "compensate", "", `{"ok":true}`),
	)
	// Wait for the engine to have consumed them: a later, real reply
	// behind them in the partition is applied first by nobody, so poll the
	// saga for a while instead.
	time.Sleep(2 * time.Second)
	after := get(t, d.e, id)
	if after.Status != saga.StatusRunning || after.Step != "hold" || after.Version != before.Version {
		t.Fatalf("stale replies moved the saga: %s at %s, version %d → %d\n%s", after.Status, after.Step, before.Version, after.Version, timeline(after))
	}
	if n := d.onReply.of(id); n != 1 {
		t.Errorf("OnReply ran %d times", n)
	}
	var st order
	if err := after.DecodeState(&st); err != nil || st.Got != `"first"` {
		t.Errorf("state Got %q (%v), want the first reply's result", st.Got, err)
	}
	if _, err := d.e.Signal(ctxT(t, 10*time.Second), saga.Signal{SagaID: id, Name: "go"}); err != nil {
		t.Fatal(err)
	}
	in := waitEnded(t, d.e, id, 20*time.Second)
	if in.Status != saga.StatusCompleted || d.fx.of(t, id, "ship/forward") != 1 {
		t.Fatalf("%s, ship effects %d\n%s", in.Status, d.fx.of(t, id, "ship/forward"), timeline(in))
	}
}

// TestReplyAfterTheSagaCompensated: charge times out (reply_timeout), the
// saga compensates (the refund, its reply included), and then charge's
// success arrives: it must be dropped, OnReply must not run, the saga
// must stay compensated.
func TestReplyAfterTheSagaCompensated(t *testing.T) {
	d := newDeafRig(t, 2*time.Second, saga.Config{RescueInterval: time.Second})
	id := d.start(t, order{ID: "late"})
	d.waitSent(t, id)
	in := waitEnded(t, d.e, id, 30*time.Second)
	if in.Status != saga.StatusCompensated {
		t.Fatalf("%s\n%s", in.Status, timeline(in))
	}
	if in.LastError == nil || in.LastError.Code != saga.CodeReplyTimeout {
		t.Errorf("last error %+v, want %s", in.LastError, saga.CodeReplyTimeout)
	}
	if n := len(d.callsOf(id, "svc.refund")); n != 1 {
		t.Errorf("the refund ran %d times at the participant, want 1 (after a timeout the step's own compensation runs)", n)
	}
	d.send(t, forgedReply(id, "charge", "forward", "", `{"ok":true,"result":"late"}`),
		forgedReply(id, "charge", "compensate", "", `{"ok":true}`))
	time.Sleep(2 * time.Second)
	after := get(t, d.e, id)
	if after.Status != saga.StatusCompensated || after.Version != in.Version || len(after.History) != len(in.History) {
		t.Errorf("a reply after the end moved the saga: %s v%d→v%d\n%s", after.Status, in.Version, after.Version, timeline(after))
	}
	if n := d.onReply.of(id); n != 0 {
		t.Errorf("OnReply ran %d times for a reply after compensation", n)
	}
	if n := d.fx.of(t, id, "ship/forward"); n != 0 {
		t.Errorf("ship ran %d times after compensation", n)
	}
}

// TestReplyAroundTheTimeout: a reply well within a 4 s Timeout completes
// the saga; a reply a little after the Timeout (before the rescuer's next
// run, or after it) either completes it (OnReply once) or is dropped
// (compensated, OnReply never): never both.
func TestReplyAroundTheTimeout(t *testing.T) {
	d := newDeafRig(t, 4*time.Second, saga.Config{RescueInterval: time.Second})
	before := d.start(t, order{ID: "before"})
	after := d.start(t, order{ID: "after"})
	d.waitSent(t, before)
	d.waitSent(t, after)
	// The participant has the after saga's command: it was sent, and its
	// Timeout started, before this moment.
	sentBy := time.Now()
	time.Sleep(1500 * time.Millisecond)
	d.send(t, forgedReply(before, "charge", "forward", "", `{"ok":true,"result":"in time"}`))
	in := waitEnded(t, d.e, before, 20*time.Second)
	if in.Status != saga.StatusCompleted || d.onReply.of(before) != 1 {
		t.Fatalf("a reply in time: %s, OnReply %d\n%s", in.Status, d.onReply.of(before), timeline(in))
	}
	// The after saga's command went out at about the same time; wait past
	// its Timeout (not for the rescuer) and reply.
	time.Sleep(time.Until(sentBy.Add(4*time.Second + 300*time.Millisecond)))
	d.send(t, forgedReply(after, "charge", "forward", "", `{"ok":true,"result":"late"}`))
	in = waitEnded(t, d.e, after, 30*time.Second)
	t.Logf("a reply just after the timeout: %s, OnReply %d, last error %+v", in.Status, d.onReply.of(after), in.LastError)
	switch in.Status {
	case saga.StatusCompleted:
		if d.onReply.of(after) != 1 || d.fx.of(t, after, "ship/forward") != 1 {
			t.Errorf("completed with OnReply %d, ship %d", d.onReply.of(after), d.fx.of(t, after, "ship/forward"))
		}
	case saga.StatusCompensated:
		if d.onReply.of(after) != 0 || d.fx.of(t, after, "ship/forward") != 0 {
			t.Errorf("compensated with OnReply %d, ship %d", d.onReply.of(after), d.fx.of(t, after, "ship/forward"))
		}
	default:
		t.Errorf("%s\n%s", in.Status, timeline(in))
	}
}

// TestRemoteTimeoutExtremes: a remote step's Timeout of 0 (the default, a
// minute), negative, 1 ns, 1 µs and the largest duration, with a
// participant that answers at once. Each must be refused by Register
// naming the field, or give a saga that ends consistently: completed
// with the charge applied once, or compensated with a refund (or, for
// the tiny Timeouts, failed when every refund timed out too); never
// stuck.
func TestRemoteTimeoutExtremes(t *testing.T) {
	cases := []struct {
		name    string
		timeout time.Duration
	}{
		{"zero", 0},
		{"negative", -time.Second},
		{"one ns", time.Nanosecond},
		{"one us", time.Microsecond},
		{"largest", math.MaxInt64},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var replies atomic.Int32
			def := saga.Define("pay",
				saga.Step[order]{Name: "reserve", Action: noop, Compensate: noop},
				saga.Step[order]{Name: "charge", Timeout: c.timeout, Remote: chargeRemote(func(_ context.Context, _ *saga.StepRun, o *order, res json.RawMessage) error {
					replies.Add(1)
					o.Got = string(res)
					return nil
				})},
				saga.Step[order]{Name: "ship", Action: noop})
			r := newRig(t, def, rigOpts{cfg: saga.Config{RescueInterval: time.Second}, mayRefuse: true})
			if r.regErr != nil {
				t.Logf("refused: %v", r.regErr)
				if !strings.Contains(r.regErr.Error(), "Timeout") {
					t.Errorf("the refusal does not name Timeout: %v", r.regErr)
				}
				return
			}
			id := r.start(t, order{ID: c.name})
			in := waitEnded(t, r.e, id, 40*time.Second)
			t.Logf("Timeout %v: %s, last error %+v, charge calls %d, refunds %d", c.timeout, in.Status, in.LastError,
				len(r.callsOf(id, "svc.charge")), len(r.callsOf(id, "svc.refund")))
			switch in.Status {
			case saga.StatusCompleted:
				if replies.Load() != 1 {
					t.Errorf("completed with OnReply run %d times", replies.Load())
				}
			case saga.StatusCompensated:
				if len(r.callsOf(id, "svc.refund")) == 0 {
					t.Errorf("compensated without a refund\n%s", timeline(in))
				}
			case saga.StatusFailed:
				// A Timeout of 1 ns or 1 µs bounds the refund too: when
				// the charge's reply loses the race with the rescuer, every
				// refund times out as well, and the saga fails once
				// CompensateRetry is spent, as documented.
				if c.timeout > time.Microsecond || in.LastError == nil || in.LastError.Code != saga.CodeReplyTimeout || len(r.callsOf(id, "svc.refund")) == 0 {
					t.Errorf("%s %+v\n%s", in.Status, in.LastError, timeline(in))
				}
			default:
				t.Errorf("%s\n%s", in.Status, timeline(in))
			}
			if n := len(r.callsOf(id, "svc.charge")); n != 1 {
				t.Errorf("charge reached the participant %d times", n)
			}
		})
	}
}

// TestLargestRemoteTimeoutWaits: with the largest Timeout and no reply,
// the rescuer must not time the step out (no overflow into the past),
// and a reply much later still completes the saga.
func TestLargestRemoteTimeoutWaits(t *testing.T) {
	d := newDeafRig(t, math.MaxInt64, saga.Config{RescueInterval: time.Second})
	id := d.start(t, order{ID: "forever"})
	d.waitSent(t, id)
	for i := 0; i < 3; i++ {
		if _, err := d.e.RescueNow(ctxT(t, 10*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	c := sagatest.NewClock(d.pool, d.schema, d.e)
	if err := c.Advance(ctxT(t, 10*time.Second), 24*time.Hour*365); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	in := get(t, d.e, id)
	t.Logf("next check at %v", in.NextCheckAt)
	if in.Status != saga.StatusRunning || in.Step != "charge" {
		t.Fatalf("a step with the largest Timeout timed out within a (clock) year: %s\n%s", in.Status, timeline(in))
	}
	if in.NextCheckAt != nil && in.NextCheckAt.Before(time.Now().Add(100*365*24*time.Hour)) {
		t.Errorf("the deadline of a 292-year Timeout is %v", in.NextCheckAt)
	}
	d.send(t, forgedReply(id, "charge", "forward", "", `{"ok":true,"result":1}`))
	in = waitEnded(t, d.e, id, 20*time.Second)
	if in.Status != saga.StatusCompleted || d.onReply.of(id) != 1 {
		t.Fatalf("%s OnReply %d\n%s", in.Status, d.onReply.of(id), timeline(in))
	}
}
