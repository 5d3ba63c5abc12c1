package review15

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

func overran(in *saga.Instance) []string {
	var out []string
	for _, e := range in.History {
		if e.ErrorCode == saga.CodeAbandonedRunOn {
			out = append(out, e.Step)
		}
	}
	return out
}

// deafBill: bill (Timeout 1 s, HandlerGrace 200 ms) whose Command ignores
// its ctx for 2 s on its first `deaf` builds. limit is
// KafkaConfig.ReplyStepLimit (0: its default, 200 ms; negative: none).
func deafBill(t *testing.T, name string, deaf int32, attempts int, limit time.Duration) (*rig, *saga.Instance, *counter) {
	t.Helper()
	r := newRig(t, name, nil)
	var builds counter
	var sleepers testkit.Stragglers
	t.Cleanup(sleepers.Wait)
	r.billCmd = func(_ context.Context, _ *saga.StepRun, o *ord) (any, error) {
		if builds.Add(o.ID) <= deaf {
			defer sleepers.Enter()()
			time.Sleep(2 * time.Second)
		}
		return cmd{ID: o.ID}, nil
	}
	r.billTime = time.Second
	def := r.def(attempts)
	r.start(t, func(cfg *saga.Config) {
		cfg.HandlerGrace = 200 * time.Millisecond
		cfg.Kafka.ReplyStepLimit = limit
	}, def)
	st, err := saga.Start(context.Background(), r.engine, def, ord{ID: "o"}, nil)
	require.NoError(t, err)
	return r, r.ended(t, st.ID), &builds
}

// bill's Command ignores its ctx once, in pay's reply's transaction on the
// reply worker: at ReplyStepLimit (200 ms, before bill's Timeout) it is
// given up, nothing of it recorded (no handler_overran, no abandonment),
// the reply goes with the transaction and its message runs again; the
// reply is then written on its own with bill's command, and an engine
// worker builds it. The saga completes; OnReply's effect once, pay and
// bill charged once, built twice.
func TestDeafBillCommandOnceIsHandedOffAndTheReplyKept(t *testing.T) {
	t.Parallel()
	r, in, builds := deafBill(t, "deafonce", 1, 3, 0)
	require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", types(in), in.LastError)
	require.Empty(t, overran(in), "%v", types(in))
	require.Equal(t, int64(0), r.engine.Stats().HandlersAbandoned)
	require.Equal(t, int64(1), r.engine.Stats().StepsHandedOff)
	require.Equal(t, int32(2), builds.Get("o"))
	require.Equal(t, []string{"pay", "bill"}, r.calls(t, in.ID))
	require.Equal(t, []string{"pick", "paid", "ship"}, r.fx.List(t, in.ID))
	require.Equal(t, 1, r.sent(t, in.ID, "bill"))
	require.Equal(t, 1, r.sent(t, in.ID, "pay"))
}

// The same with no ReplyStepLimit: bill's Command, past Timeout +
// HandlerGrace, is abandoned (handler_overran on bill); the reply's message
// runs again and the reply is written on its own with bill's command. The
// same end, built twice.
func TestDeafBillCommandOnceIsAbandonedAndTheReplyKept(t *testing.T) {
	t.Parallel()
	r, in, builds := deafBill(t, "deafoncenolimit", 1, 3, -1)
	require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", types(in), in.LastError)
	require.Equal(t, []string{"bill"}, overran(in), "%v", types(in))
	require.Equal(t, int64(1), r.engine.Stats().HandlersAbandoned)
	require.Equal(t, int64(0), r.engine.Stats().StepsHandedOff)
	require.Equal(t, int32(2), builds.Get("o"))
	require.Equal(t, []string{"pay", "bill"}, r.calls(t, in.ID))
	require.Equal(t, []string{"pick", "paid", "ship"}, r.fx.List(t, in.ID))
	require.Equal(t, 1, r.sent(t, in.ID, "bill"))
	require.Equal(t, 1, r.sent(t, in.ID, "pay"))
}

// bill's Command is always deaf, with two attempts: "a step that never
// returns fails for good": the saga ends (no loop), each abandoned build
// recorded, pay refunded, pick undone, OnReply's effect once. With the
// default ReplyStepLimit the build on the reply worker is handed off and
// not an attempt: the worker's two attempts are abandoned and recorded,
// three builds in all (four under load, see below). With none, F1: the
// uncounted abandonment on the reply worker is recorded too (3, or 4 under
// load, for MaxAttempts 2).
func TestAlwaysDeafBillCommandFailsForGood(t *testing.T) {
	t.Parallel()
	for _, limit := range []time.Duration{0, -1} {
		t.Run(fmt.Sprint(limit), func(t *testing.T) {
			t.Parallel()
			r, in, builds := deafBill(t, fmt.Sprint("deafever", limit+1), 100, 2, limit)
			require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", types(in), in.LastError)
			require.Equal(t, "bill", in.LastError.Step, "%+v", in.LastError)
			handedOff := int(r.engine.Stats().StepsHandedOff)
			// A worker's abandoned attempt can be claimed and built once
			// more before its failure is recorded (seen under load: attempt
			// 2 recorded twice, the second "superseded"), so at least.
			if limit == 0 {
				require.Equal(t, 1, handedOff)
			} else {
				require.Zero(t, handedOff)
			}
			require.GreaterOrEqual(t, builds.Get("o"), int32(3), "%v", timeline(in))
			require.Equal(t, int64(int(builds.Get("o"))-handedOff), r.engine.Stats().HandlersAbandoned)
			require.Len(t, overran(in), int(builds.Get("o"))-handedOff, "each abandoned build recorded: %v", timeline(in))
			testkit.WaitFor(t, wait, "pay refunded", func() bool { return len(r.calls(t, in.ID)) == 2 })
			require.Equal(t, []string{"pay", "refund"}, r.calls(t, in.ID))
			require.Equal(t, []string{"pick", "paid", "unpick"}, r.fx.List(t, in.ID))
			require.Zero(t, r.sent(t, in.ID, "bill"))
		})
	}
}

// F1: the abandoned build in the reply's transaction is recorded as attempt
// 1, and the worker's first claim is attempt 1 again: with MaxAttempts 2 the
// deaf Command runs three times (each holding a worker for Timeout +
// HandlerGrace), and the timeline shows attempt 1 failing twice. The doc:
// "the step is then not run at once but left to be claimed on its own, so
// that its attempts count". (With the default ReplyStepLimit the reply
// worker's build is handed off before it can be abandoned.)
func TestF1AbandonedChainedBillCommandCountsAsAnAttempt(t *testing.T) {
	t.Skip("FINDING F1: an abandoned Command run in a reply's transaction is not counted: MaxAttempts 2 runs it 3 times, attempt 1 recorded twice")
	t.Parallel()
	_, in, builds := deafBill(t, "deaff1", 100, 2, -1)
	require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", types(in), in.LastError)
	require.Equal(t, int32(2), builds.Get("o"), "MaxAttempts 2: %v", timeline(in))
	var attempts []int
	for _, e := range in.History {
		if e.ErrorCode == saga.CodeAbandonedRunOn {
			attempts = append(attempts, e.Attempt)
		}
	}
	require.Equal(t, []int{1, 2}, attempts, "%v", timeline(in))
}

// mixRun: one deaf bill Command (its first build ignores its ctx for 9 s;
// bill's Timeout 6 s, HandlerGrace 200 ms) among fifteen healthy sagas,
// two workers; limit is KafkaConfig.ReplyStepLimit (0: its default;
// negative: none).
func mixRun(t *testing.T, name string, batch int, deafOne bool, limit time.Duration) (*rig, map[string]*saga.Instance, *counter) {
	t.Helper()
	r := newRig(t, name, nil)
	var builds counter
	var sleepers testkit.Stragglers
	t.Cleanup(sleepers.Wait)
	// (The review had bill's Timeout 1 s and the deaf build 2 s; the
	// control below then failed on a loaded machine with no deaf build at
	// all. At 2.5 s a CI run under the race detector saw the deaf saga's
	// own bill, sent by a worker after the hand-off, time out; at 4 s a
	// healthy saga's bill, on a machine running three test processes.)
	r.billTime = 6 * time.Second
	r.billCmd = func(_ context.Context, _ *saga.StepRun, o *ord) (any, error) {
		if builds.Add(o.ID) == 1 && o.ID == "deaf" {
			defer sleepers.Enter()()
			time.Sleep(9 * time.Second)
		}
		return cmd{ID: o.ID}, nil
	}
	def := r.def(3)
	r.start(t, func(cfg *saga.Config) {
		cfg.HandlerGrace = 200 * time.Millisecond
		cfg.Workers = 2
		cfg.BatchSize = batch
		cfg.Kafka.ReplyStepLimit = limit
	}, def)
	ctx := context.Background()
	ids := map[string]uuid.UUID{}
	for i := range 16 {
		n := fmt.Sprint("h-", i)
		if i == 3 && deafOne {
			n = "deaf"
		}
		st, err := saga.Start(ctx, r.engine, def, ord{ID: n}, nil)
		require.NoError(t, err)
		ids[n] = st.ID
	}
	out := map[string]*saga.Instance{}
	for n, id := range ids {
		out[n] = r.ended(t, id)
	}
	return r, out, &builds
}

// One deaf bill Command among fifteen healthy sagas, with no
// ReplyStepLimit: the deaf one completes (abandoned once, built twice);
// every saga's effects are exactly once whichever way it ended: completed
// (pick, paid, ship; pay, bill), or, for a healthy saga whose bill reply
// waited behind the deaf run past bill's Timeout (F2 without the limit),
// compensated with reply_timeout on bill (pay and bill both undone at the
// participant).
func TestDeafBillCommandAmongHealthySagas(t *testing.T) {
	t.Parallel()
	r, ins, builds := mixRun(t, "deafmix", 16, true, -1)
	for n, in := range ins {
		r.completedOrTimedOut(t, n, in, n == "deaf")
	}
	require.Equal(t, int64(1), r.engine.Stats().HandlersAbandoned)
	require.Equal(t, int32(2), builds.Get("deaf"))
}

// F2 (fixed): a Command that runs in a reply's transaction holds the
// reply consumer's batch, so the replies of other sagas behind it wait for
// it; without a limit a deaf one held them for bill's Timeout +
// HandlerGrace, longer than the Timeout that "also bounds the wait for the
// reply", and healthy sagas whose bill was sent just before failed with
// reply_timeout, because of another saga's Command (BatchSize 1 did not
// help: the replies behind it wait on the same partition's consumer). With
// the default ReplyStepLimit (200 ms) the deaf build is given up and
// handed to an engine worker: every saga completes, the deaf one built
// twice, nothing abandoned. With no limit the test fails on the counts
// every run (nothing handed off, the deaf build abandoned), and often on a
// healthy saga compensated with reply_timeout (every run at bill's former
// 2.5 s Timeout, one run in two at 3 s).
func TestF2DeafBillCommandDoesNotFailOtherSagas(t *testing.T) {
	t.Parallel()
	for round, batch := range []int{16, 1, 16, 1} {
		r, ins, builds := mixRun(t, fmt.Sprint("deaff2", round), batch, true, 0)
		for n, in := range ins {
			require.Equal(t, saga.StatusCompleted, in.Status, "BatchSize %d, %s: %v %+v", batch, n, timeline(in), in.LastError)
			require.Equal(t, []string{"pay", "bill"}, r.calls(t, in.ID), n)
		}
		// The deaf build is handed off; on a loaded machine a healthy step
		// can run past the 200 ms limit too and be handed off as well (a CI
		// run saw 2), which the docs allow: every saga still completes once.
		require.GreaterOrEqual(t, r.engine.Stats().StepsHandedOff, int64(1), "BatchSize %d", batch)
		require.Zero(t, r.engine.Stats().HandlersAbandoned, "BatchSize %d", batch)
		require.Equal(t, int32(2), builds.Get("deaf"), "BatchSize %d", batch)
	}
}

// Control for F2: the same sixteen sagas with bill's 6 s Timeout and no
// deaf Command all complete, on BatchSize 16 and 1.
func TestSixteenSagasWithoutADeafBillComplete(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{16, 1} {
		t.Run(fmt.Sprint(batch), func(t *testing.T) {
			t.Parallel()
			r, ins, _ := mixRun(t, fmt.Sprint("deafctl", batch), batch, false, 0)
			for n, in := range ins {
				require.Equal(t, saga.StatusCompleted, in.Status, "BatchSize %d, %s: %v %+v", batch, n, timeline(in), in.LastError)
				require.Equal(t, []string{"pay", "bill"}, r.calls(t, in.ID), n)
			}
			require.Zero(t, r.engine.Stats().HandlersAbandoned)
		})
	}
}

// completedOrTimedOut checks a saga's effects whichever way it ended:
// completed (pick, paid, ship; pay, bill once each), or, unless mustComplete,
// compensated because bill's reply waited past its Timeout behind another
// saga's deaf Command (F2): reply_timeout on bill, bill and pay both undone
// at the participant, pick undone, "paid" once.
func (r *rig) completedOrTimedOut(t *testing.T, n string, in *saga.Instance, mustComplete bool) {
	t.Helper()
	id := in.ID
	if mustComplete || in.Status == saga.StatusCompleted {
		require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v %+v", n, timeline(in), in.LastError)
		require.Equal(t, []string{"pay", "bill"}, r.calls(t, id), n)
		require.Equal(t, []string{"pick", "paid", "ship"}, r.fx.List(t, id), "%s: %v", n, timeline(in))
		require.Equal(t, 1, r.sent(t, id, "bill"), n)
		return
	}
	require.Equal(t, saga.StatusCompensated, in.Status, "%s: %v %+v", n, timeline(in), in.LastError)
	require.Equal(t, saga.CodeReplyTimeout, in.LastError.Code, "%s: %+v", n, in.LastError)
	testkit.WaitFor(t, wait, n+": bill and pay undone", func() bool { return len(r.calls(t, id)) == 4 })
	require.ElementsMatch(t, []string{"pay", "bill", "unbill", "refund"}, r.calls(t, id), n)
	require.Equal(t, []string{"pick", "paid", "unpick"}, r.fx.List(t, id), "%s: %v", n, timeline(in))
}

// A cancel (or a pause) committed while bill's Command runs deaf in pay's
// reply's transaction: the Command ignores the cancelled ctx until the
// operator's call has returned and past Timeout 3 s + HandlerGrace, and is
// abandoned, taking the reply with it; the reply's message runs again.
// Cancel: bill is never sent, pay refunded, pick undone, "paid" at most
// once. Pause: bill is not sent until Resume, then once, and the saga
// completes with "paid" once.
//
// No ReplyStepLimit: with its default (200 ms) the reply worker gives the
// Command up at once and an engine worker builds bill again, which on a
// loaded machine can happen before the operator's call commits (bill then
// goes out legitimately, before the pause: one CI run saw it), and the
// test would no longer be about an operator acting while the step runs.
// The Command also waits for the operator's call to return, for the same
// reason: a fixed sleep raced the call under load.
func TestOperatorWhileBillCommandIsDeaf(t *testing.T) {
	t.Parallel()
	for _, op := range []string{"cancel", "pause"} {
		t.Run(op, func(t *testing.T) {
			t.Parallel()
			r := newRig(t, "deafop"+op, nil)
			var builds counter
			var sleepers testkit.Stragglers
			t.Cleanup(sleepers.Wait)
			entered := make(chan struct{}, 1)
			acted := make(chan struct{})
			r.billTime = 3 * time.Second
			r.billCmd = func(_ context.Context, _ *saga.StepRun, o *ord) (any, error) {
				if builds.Add(o.ID) == 1 {
					defer sleepers.Enter()()
					began := time.Now()
					entered <- struct{}{}
					select {
					case <-acted:
					case <-time.After(wait):
					}
					// Past Timeout + HandlerGrace, ignoring the context.
					time.Sleep(time.Until(began.Add(4 * time.Second)))
				}
				return cmd{ID: o.ID}, nil
			}
			def := r.def(3)
			r.start(t, func(cfg *saga.Config) {
				cfg.HandlerGrace = 200 * time.Millisecond
				cfg.Kafka.ReplyStepLimit = -1
			}, def)
			ctx := context.Background()
			st, err := saga.Start(ctx, r.engine, def, ord{ID: "o"}, nil)
			require.NoError(t, err)
			testkit.Recv(t, entered, wait, "bill's deaf Command")
			if op == "cancel" {
				require.NoError(t, r.engine.Cancel(ctx, st.ID, "stop"))
				close(acted)
				in := r.ended(t, st.ID)
				require.Equal(t, saga.StatusCompensated, in.Status, "%v %+v", timeline(in), in.LastError)
				require.Equal(t, saga.CodeCancelled, in.LastError.Code, "%v %+v", timeline(in), in.LastError)
				testkit.WaitFor(t, wait, "pay refunded", func() bool { return len(r.calls(t, st.ID)) >= 2 })
				testkit.Hold(t, time.Second, "bill never sent", func() bool { return r.sent(t, st.ID, "bill") == 0 })
				require.Equal(t, []string{"pay", "refund"}, r.calls(t, st.ID), "%v", timeline(in))
				require.Equal(t, 1, r.fx.Count(t, st.ID, "pick"))
				require.Equal(t, 1, r.fx.Count(t, st.ID, "unpick"))
				require.LessOrEqual(t, r.fx.Count(t, st.ID, "paid"), 1, "%v", r.fx.List(t, st.ID))
				return
			}
			require.NoError(t, r.engine.Pause(ctx, st.ID, "look"))
			close(acted)
			sagatest.Wait(t, r.engine, st.ID, sagatest.Event("step_completed:pay"), &sagatest.WaitOpts{Timeout: wait})
			testkit.Hold(t, 1500*time.Millisecond, "bill held while paused", func() bool { return r.sent(t, st.ID, "bill") == 0 })
			require.NotNil(t, r.get(t, st.ID).Paused)
			require.NoError(t, r.engine.Resume(ctx, st.ID, "ok"))
			in := r.ended(t, st.ID)
			require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", timeline(in), in.LastError)
			require.Equal(t, 1, r.sent(t, st.ID, "bill"))
			require.Equal(t, []string{"pay", "bill"}, r.calls(t, st.ID))
			require.Equal(t, []string{"pick", "paid", "ship"}, r.fx.List(t, st.ID), "%v", timeline(in))
		})
	}
}
