package review16

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/wire"
)

var hostile = "\x00\xff\xfe" + testkit.RandomLetters(10_000) + "\x00"

// pay's result for saga "bad" carries a NUL, invalid UTF-8 and 10 kB, which
// OnReply copies into the state; its reply arrives in the same partition,
// at about the same time (both started at once), as saga "slow"'s, whose ship is given up at the
// limit. Doc (guarantee 8): bytes PostgreSQL refuses "in any field of a
// message ... or a reply are made storable or dead-lettered, never
// retried; an outcome PostgreSQL refuses all the same parks its saga
// ([CodeInvalidOutcome]) instead of losing the batch". So: "slow" completes
// with ship once; "bad" ends (whatever its end) with nothing doubled;
// a saga started after completes; the participant ran pay once each.
func TestHostileReplyPayloadBesideAHandOff(t *testing.T) {
	t.Parallel()
	r := newRig(t, "badpayload", "", nil)
	r.payResult = func(c cmd) map[string]string {
		if c.ID == "bad" {
			return map[string]string{"ref": hostile}
		}
		return map[string]string{"ref": "pay-" + c.ID}
	}
	r.ship = func(ctx context.Context, run *saga.StepRun, o *ord, n int32) error {
		if o.ID == "slow" && n == 1 {
			waitCtx(ctx, 5*time.Second)
			return ctx.Err()
		}
		return r.fx.Record(ctx, run, "ship")
	}
	def := r.def(defOpts{})
	r.start(t, func(cfg *saga.Config) { cfg.BatchSize = 16 }, def)
	ids := startMany(t, r, def, []string{"slow", "bad"})
	in := r.ended(t, ids["slow"])
	require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", timeline(in), in.LastError)
	require.Equal(t, []string{"pick", "paid", "ship", "done"}, r.fx.List(t, ids["slow"]))
	bad := r.ended(t, ids["bad"])
	require.Contains(t, []saga.Status{saga.StatusCompensated, saga.StatusFailed}, bad.Status, "%v", timeline(bad))
	require.NotEmpty(t, bad.LastError.Code, "a coded error: %+v", bad.LastError)
	for what, n := range r.fx.Counts(t, ids["bad"]) {
		require.LessOrEqual(t, n, 1, "%s doubled: %v", what, r.fx.List(t, ids["bad"]))
	}
	after := startMany(t, r, def, []string{"after"})
	inAfter := r.ended(t, after["after"])
	require.Equal(t, saga.StatusCompleted, inAfter.Status, "%v %+v", timeline(inAfter), inAfter.LastError)
	require.Equal(t, []string{"pay"}, r.calls(t, ids["slow"]))
	require.Equal(t, "pay", r.calls(t, ids["bad"])[0])
}

// While saga "slow"'s ship is held on the reply worker (to be cut), three
// copies of its pay reply are produced straight to the reply topic with
// hostile headers: an extra header of NUL, invalid UTF-8 and 10 kB; the
// message id replaced by that; the step key replaced by that. They wait
// behind the reply being handed off. Doc: made storable or dead-lettered,
// never retried, and workers keep serving everything else. So "slow"
// completes with "paid" and ship once, pay completed once; the dead
// letters, if any, are at most three and stay so (no retry loop); a saga
// started after completes.
func TestHostileReplyHeadersBehindAHandOff(t *testing.T) {
	t.Parallel()
	r := newRig(t, "badheaders", "", nil)
	first := testkit.NewGate()
	t.Cleanup(first.Open)
	r.ship = func(ctx context.Context, run *saga.StepRun, o *ord, n int32) error {
		if n == 1 {
			if err := first.Pass(ctx); err != nil {
				return err
			}
		}
		return r.fx.Record(ctx, run, "ship")
	}
	def := r.def(defOpts{})
	r.start(t, nil, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, r.engine, def, ord{ID: "slow"}, nil)
	require.NoError(t, err)
	testkit.WaitFor(t, wait, "ship's first run", func() bool { return first.Entered() == 1 })
	msgs, err := r.kc.ReadAll(ctx, r.h.Replies)
	require.NoError(t, err)
	require.Len(t, msgs, 1)
	orig := msgs[0]
	var out []kafka.Message
	for _, mut := range []string{"extra", wire.HeaderMessageID, "step-key"} {
		m := kafka.Message{Key: orig.Key, Value: orig.Value}
		for _, h := range orig.Headers {
			v := h.Value
			if h.Key == mut || (mut == "step-key" && strings.Contains(h.Key, "step-key")) {
				v = []byte(hostile)
			}
			m.Headers = append(m.Headers, kafka.Header{Key: h.Key, Value: v})
		}
		if mut == "extra" {
			m.Headers = append(m.Headers, kafka.Header{Key: "x-\x00\xff", Value: []byte(hostile)})
		}
		out = append(out, m)
	}
	tr := &kafka.Transport{}
	w := &kafka.Writer{Addr: kafka.TCP(r.kc.Addrs()...), Topic: r.h.Replies, BatchTimeout: 10 * time.Millisecond, Transport: tr}
	require.NoError(t, w.WriteMessages(ctx, out...))
	require.NoError(t, w.Close())
	tr.CloseIdleConnections()
	in := r.ended(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", timeline(in), in.LastError)
	after := startMany(t, r, def, []string{"after"})
	inAfter := r.ended(t, after["after"])
	require.Equal(t, saga.StatusCompleted, inAfter.Status, "%v %+v", timeline(inAfter), inAfter.LastError)
	dl := r.deadLetters(t)
	require.LessOrEqual(t, dl, 3)
	testkit.Hold(t, time.Second, "no retry loop", func() bool { return r.deadLetters(t) == dl })
	in = r.get(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, 1, r.fx.Count(t, st.ID, "paid"), "%v", timeline(in))
	require.Equal(t, 1, r.fx.Count(t, st.ID, "ship"), "%v", timeline(in))
	require.Equal(t, 1, count(in, "step_completed", "pay"), "%v", timeline(in))
	require.Equal(t, []string{"pay"}, r.calls(t, st.ID))
	t.Logf("dead letters: %d; history %v", dl, timeline(in))
}
