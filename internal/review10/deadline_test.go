package review10_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

type order struct {
	N int `json:"n"`
}

// local is a step that records its name in run.Tx, with a compensation
// that records "c:"+name.
func (e *env) local(name string, timeout time.Duration) saga.Step[order] {
	return saga.Step[order]{Name: name, Timeout: timeout,
		Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
			return e.fx.Record(ctx, run, name)
		},
		Compensate: func(ctx context.Context, run *saga.StepRun, _ *order) error {
			return e.fx.Record(ctx, run, "c:"+name)
		}}
}

// sentSkew is how much less than the Timeout a reply deadline minus the
// command_sent event's time may measure: the two times are taken at
// different moments of the write (the deadline by the saga's update, the
// event's time by its history row), which can be tens of milliseconds
// apart on a loaded machine (a CI run measured 1.943 s for a 2 s Timeout).
// The upper bound is what tells a deadline of Timeout plus room.
const sentSkew = 250 * time.Millisecond

func within(t *testing.T, what string, got, lo, hi time.Duration) {
	t.Helper()
	require.Truef(t, got >= lo && got <= hi, "%s: %s, want between %s and %s", what, got, lo, hi)
}

// A new saga's first check is its first step's timeout away, its deadline
// that plus twice RescueSlack (docs/architecture.md "Time"); a lost first
// command is rescued once that deadline passed and not before, after one
// recheck; the saga then completes with each effect once.
func TestFirstCommandLostRescuedAtDeadline(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const T, slack = 4 * time.Second, time.Second
	def := saga.Define("first", e.local("s1", T), e.local("s2", time.Second))
	client := testkit.NewEngine(t, e.Pool, e.cfg(slack), def)

	st, err := saga.Start(ctx, client, def, order{}, nil)
	require.NoError(t, err)
	var created time.Time
	require.NoError(t, e.Pool.QueryRow(ctx, `SELECT created_at FROM `+e.Table("saga_instances")+` WHERE id = $1`, st.ID).Scan(&created))
	r := e.read(t, st.ID)
	require.NotNil(t, r.check, "a new saga has a first check: %s", r)
	require.NotNil(t, r.deadline, "a new saga has a deadline: %s", r)
	within(t, "first check - start", r.check.Sub(created), T-50*time.Millisecond, T+margin)
	within(t, "first deadline - start", r.deadline.Sub(created), T+2*slack-50*time.Millisecond, T+2*slack+margin)
	e.requireTruth(t, client, st.ID, r)

	require.Equal(t, 1, e.deleteCommands(t, st.ID))
	// Past the first check, before the deadline: rechecked, not rescued.
	require.NoError(t, e.clk.Advance(ctx, T+slack/2))
	res, err := client.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, 0, rescued(res), "rescued before the deadline: %+v, %s", res, e.read(t, st.ID))
	require.Equal(t, 1, res.Rechecked, "the lower bound passed before the deadline: %+v", res)
	after := e.read(t, st.ID)
	require.WithinDuration(t, *r.deadline, *after.deadline, T+slack/2+time.Millisecond) // moved back by the Advance only
	require.NotNil(t, after.check)
	require.WithinDuration(t, *after.deadline, *after.check, time.Millisecond, "the recheck moves next_check_at up to the deadline: %s", after)

	e.stepToRescue(t, client, st.ID, 200*time.Millisecond, 10*time.Second)
	require.Equal(t, 1, e.read(t, st.ID).attempt)

	testkit.Start(t, client)
	in := testkit.WaitEnded(t, client, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, map[string]int{"s1": 1, "s2": 1}, e.fx.Counts(t, st.ID))
}

// A command lost after a step's transition (the step's Timeout is shorter
// than the first step's, then longer) is found at most the step's Timeout
// plus twice RescueSlack after it was written, and not before its deadline.
func TestLostMidSagaCommands(t *testing.T) {
	for _, tc := range []struct {
		name   string
		t1, t2 time.Duration
	}{{"shorter", 6 * time.Second, 2 * time.Second}, {"longer", 2 * time.Second, 6 * time.Second}} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			const slack = time.Second
			def := saga.Define("mid", e.local("s1", tc.t1), e.local("s2", tc.t2), e.local("s3", time.Second))
			eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(slack), def)
			e.loseNext(t, "%/s2/forward/%", 0, 1)
			st, err := saga.Start(context.Background(), eng, def, order{}, nil)
			require.NoError(t, err)
			waitFor(t, "s2's command lost", func() bool { return e.dropped(t, "%/s2/forward/%") == 1 })
			written := e.eventAt(t, st.ID, saga.EventStepCompleted)
			r := e.read(t, st.ID)
			require.Equal(t, "s2", r.step)
			require.Equal(t, 0, e.pendingCommands(t, st.ID))
			require.NotNil(t, r.deadline, "a running saga has a deadline: %s", r)
			// Config.RescueSlack: "A lost command is so found at most the
			// step's Timeout plus twice RescueSlack after it was written."
			// Checked without stopping, to see when it is found.
			if got := r.deadline.Sub(written); got < tc.t2 || got > tc.t2+2*slack+margin {
				t.Errorf("a lost s2 command (Timeout %s, RescueSlack %s) is due for rescue %s after it was written, want between %s and %s: %s",
					tc.t2, slack, got, tc.t2, tc.t2+2*slack+margin, r)
			}

			e.stepToRescue(t, eng, st.ID, 250*time.Millisecond, 20*time.Second)
			in := testkit.WaitEnded(t, eng, st.ID)
			require.Equal(t, saga.StatusCompleted, in.Status)
			require.Equal(t, map[string]int{"s1": 1, "s2": 1, "s3": 1}, e.fx.Counts(t, st.ID))
			require.Equal(t, 1, e.events(t, st.ID, saga.EventSagaRescued, ""))
		})
	}
}

// A compensating saga whose compensation command is lost is rescued after
// its deadline and compensates once.
func TestLostCompensationCommand(t *testing.T) {
	e := newEnv(t)
	const slack = time.Second
	s2 := saga.Step[order]{Name: "s2", Timeout: time.Second,
		Action: func(context.Context, *saga.StepRun, *order) error { return steps.Permanent(errors.New("no")) }}
	def := saga.Define("comp", e.local("s1", 2*time.Second), s2)
	eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(slack), def)
	e.loseNext(t, "%/s1/compensate/%", 0, 1)
	st, err := saga.Start(context.Background(), eng, def, order{}, nil)
	require.NoError(t, err)
	waitFor(t, "the compensation's command lost", func() bool { return e.dropped(t, "%/s1/compensate/%") == 1 })
	r := e.read(t, st.ID)
	require.Equal(t, "compensating", r.status)
	require.NotNil(t, r.deadline, "a compensating saga has a deadline: %s", r)

	e.stepToRescue(t, eng, st.ID, 250*time.Millisecond, 20*time.Second)
	in := testkit.WaitEnded(t, eng, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, map[string]int{"s1": 1, "c:s1": 1}, e.fx.Counts(t, st.ID))
}

// A retry's command (steps.RetryAfter: "retried no sooner than d") is
// lost: the rescue comes after the deadline, and the retry does not run
// sooner than d after the failure.
func TestLostRetryCommand(t *testing.T) {
	e := newEnv(t)
	const slack, backoff = 500 * time.Millisecond, 5 * time.Second
	var mu sync.Mutex
	var attempts []time.Time
	s1 := saga.Step[order]{Name: "s1", Timeout: time.Second,
		Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
			if run.Attempt == 1 {
				return steps.RetryAfter(backoff, errors.New("429"))
			}
			var now time.Time
			if err := run.Tx.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&now); err != nil {
				return err
			}
			mu.Lock()
			attempts = append(attempts, now)
			mu.Unlock()
			return e.fx.Record(ctx, run, "s1")
		}}
	def := saga.Define("retry", s1)
	eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(slack), def)
	e.loseNext(t, "%/s1/forward/%", 1, 1)
	st, err := saga.Start(context.Background(), eng, def, order{}, nil)
	require.NoError(t, err)
	waitFor(t, "the retry's command lost", func() bool { return e.dropped(t, "%/s1/forward/%") == 1 })
	_, before := e.stepToRescue(t, eng, st.ID, 250*time.Millisecond, 20*time.Second)
	in := testkit.WaitEnded(t, eng, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, 1, e.fx.Count(t, st.ID, "s1"))
	// The schema's clock was moved back while we stepped: the failure's
	// stored time moved with it. Compare the retry with the failure as
	// stored now.
	failedNow := e.eventAt(t, st.ID, saga.EventStepFailed)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, attempts, 1)
	require.GreaterOrEqualf(t, attempts[0].Sub(failedNow), backoff,
		"RetryAfter(%s) promises no retry sooner; the rescued retry ran %s after the failure (rescuer saw %s)", backoff, attempts[0].Sub(failedNow), before)
}

// A remote step whose reply timeout is shorter than the first step's
// timeout: its deadline is exactly its Timeout after the command was sent,
// and the rescuer fails it then, not at the first step's check; one whose
// reply timeout is longer is not failed before it.
func TestRemoteReplyTimeout(t *testing.T) {
	for _, tc := range []struct {
		name       string
		t1, remote time.Duration
		step       time.Duration
	}{{"shorter", 20 * time.Second, 3 * time.Second, 250 * time.Millisecond}, {"longer", time.Second, 12 * time.Second, 500 * time.Millisecond}} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			e := newEnv(t)
			const slack = time.Second
			pay := saga.Step[order]{Name: "pay", Timeout: tc.remote, Remote: &saga.Remote[order]{Topic: "payments.commands", Type: "payments.charge",
				Command: func(context.Context, *saga.StepRun, *order) (any, error) { return map[string]int{"amount": 1}, nil }}}
			def := saga.Define("remote", e.local("s1", tc.t1), pay, e.local("s3", time.Second))
			cfg := e.cfg(slack)
			cfg.Kafka = &saga.KafkaConfig{NewReader: testkit.NewSilentReader}
			eng, _ := testkit.StartEngine(t, e.Pool, cfg, def)
			st, err := saga.Start(ctx, eng, def, order{}, nil)
			require.NoError(t, err)
			waitFor(t, "the remote command sent", func() bool { return e.events(t, st.ID, saga.EventCommandSent, "") == 1 })
			// The relay publishes it at once; no reply ever comes.
			tag, err := e.Pool.Exec(ctx, `UPDATE `+e.Table("outbox")+` SET status = 'published', published_at = now() WHERE saga_id = $1 AND status = 'pending' AND delivery = 'relay'`, st.ID)
			require.NoError(t, err)
			require.EqualValues(t, 1, tag.RowsAffected())
			sent := e.eventAt(t, st.ID, saga.EventCommandSent)
			r := e.read(t, st.ID)
			require.NotNil(t, r.deadline)
			within(t, "reply deadline - command sent (\"set exactly to the step's timeout\")", r.deadline.Sub(sent), tc.remote-sentSkew, tc.remote+margin)
			require.NotNil(t, r.check)
			require.LessOrEqual(t, r.check.Sub(*r.deadline), time.Duration(0), "next_check_at must be a lower bound of the deadline: %s", r)

			e.stepToRescue(t, eng, st.ID, tc.step, tc.remote+tc.t1+10*time.Second)
			in := testkit.WaitEnded(t, eng, st.ID)
			require.Equal(t, saga.StatusCompensated, in.Status)
			require.Equal(t, map[string]int{"s1": 1, "c:s1": 1}, e.fx.Counts(t, st.ID))
		})
	}
}

// A timer wait counts as healthy until its end; its lost command is rescued
// after the deadline (not before the wait's end), and the timer then fires
// once.
func TestLostTimerCommand(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const slack, sleep = time.Second, 8 * time.Second
	def := saga.Define("timer", e.local("s1", 2*time.Second), saga.Step[order]{Name: "nap", Timeout: 2 * time.Second, Wait: saga.Sleep[order](sleep)}, e.local("s3", time.Second))
	eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(slack), def)
	st, err := saga.Start(ctx, eng, def, order{}, nil)
	require.NoError(t, err)
	waitFor(t, "the timer written", func() bool {
		r := e.read(t, st.ID)
		return r.waitKind != nil && *r.waitKind == "timer" && e.pendingCommands(t, st.ID) == 1
	})
	require.Equal(t, 1, e.deleteCommands(t, st.ID))
	var until time.Time
	require.NoError(t, e.Pool.QueryRow(ctx, `SELECT wait_until FROM `+e.Table("saga_instances")+` WHERE id = $1`, st.ID).Scan(&until))
	r := e.read(t, st.ID)
	require.NotNil(t, r.deadline, "a timed wait has a deadline: %s", r)
	require.False(t, r.deadline.Before(until), "a saga that waits counts as healthy until its wait's end: deadline %s before wait_until %s", r.deadline, until)

	e.stepToRescue(t, eng, st.ID, 500*time.Millisecond, 30*time.Second)
	in := testkit.WaitEnded(t, eng, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, map[string]int{"s1": 1, "s3": 1}, e.fx.Counts(t, st.ID))
	require.Equal(t, 1, e.events(t, st.ID, saga.EventTimerFired, ""))
}

// waitNoDeadline asserts that saga id, which waits without a time limit,
// has no deadline (both columns NULL, Instance.NextCheckAt nil) and that a
// day later the rescuer leaves it alone.
func (e *env) waitNoDeadline(t *testing.T, g *saga.Engine, id uuid.UUID) {
	t.Helper()
	ctx := context.Background()
	r := e.read(t, id)
	require.Nil(t, r.check, "a wait without a time limit has no rescue deadline (next_check_at NULL): %s", r)
	require.Nil(t, r.due, "a wait without a time limit has no rescue deadline (due_at NULL): %s", r)
	e.requireTruth(t, g, id, r)
	require.NoError(t, e.clk.Advance(ctx, 24*time.Hour))
	res, err := g.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, 0, rescued(res), "%+v", res)
	require.Equal(t, 0, e.events(t, id, saga.EventSagaRescued, ""))
}

// After a wait without a time limit (no deadline), the saga gets a deadline
// again: a command lost at the step after it is rescued.
func TestLostCommandAfterSignalWait(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const slack = time.Second
	def := saga.Define("signal", e.local("s1", time.Second),
		saga.Step[order]{Name: "await", Timeout: time.Second, Wait: saga.OnSignal("go", func(context.Context, *saga.StepRun, *order, struct{}) error { return nil })},
		saga.Step[order]{Name: "nap", Timeout: 2 * time.Second, Wait: saga.Sleep[order](time.Second)},
		e.local("s4", time.Second))
	eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(slack), def)
	st, err := saga.Start(ctx, eng, def, order{}, nil)
	require.NoError(t, err)
	waitFor(t, "the signal wait", func() bool {
		r := e.read(t, st.ID)
		return r.waitKind != nil && *r.waitKind == "signal"
	})
	e.waitNoDeadline(t, eng, st.ID)

	e.loseNext(t, "%/nap/forward/%", 0, 1)
	_, err = eng.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "go", Payload: struct{}{}})
	require.NoError(t, err)
	waitFor(t, "nap's command lost", func() bool { return e.dropped(t, "%/nap/forward/%") == 1 })
	r := e.read(t, st.ID)
	require.Equal(t, "nap", r.step)
	require.Equal(t, 0, e.pendingCommands(t, st.ID))
	require.NotNil(t, r.check, "the rescuer finds sagas by next_check_at: a running saga whose next_check_at is NULL is never looked at: %s", r)

	e.stepToRescue(t, eng, st.ID, 250*time.Millisecond, 20*time.Second)
	waitFor(t, "the nap's timer", func() bool { return e.pendingCommands(t, st.ID) == 1 })
	require.NoError(t, e.clk.Advance(ctx, 2*time.Second))
	in := testkit.WaitEnded(t, eng, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, map[string]int{"s1": 1, "s4": 1}, e.fx.Counts(t, st.ID))
}

// The same after a parallel step (wait_kind 'branches', no deadline).
func TestLostCommandAfterParallel(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const slack = time.Second
	branch := func(name string) saga.Branch[order] {
		return saga.Branch[order]{Name: name, Timeout: time.Second,
			Action: func(ctx context.Context, run *saga.StepRun, _ order) (any, error) {
				return nil, e.fx.Record(ctx, run, name)
			}}
	}
	def := saga.Define("par",
		saga.Step[order]{Name: "fan", Timeout: time.Second, Parallel: &saga.Parallel[order]{Branches: []saga.Branch[order]{branch("b1"), branch("b2")}}},
		saga.Step[order]{Name: "nap", Timeout: 2 * time.Second, Wait: saga.Sleep[order](time.Second)},
		e.local("s3", time.Second))
	eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(slack), def)
	e.loseNext(t, "%/nap/forward/%", 0, 1)
	st, err := saga.Start(ctx, eng, def, order{}, nil)
	require.NoError(t, err)
	waitFor(t, "nap's command lost", func() bool { return e.dropped(t, "%/nap/forward/%") == 1 })
	r := e.read(t, st.ID)
	require.Equal(t, "nap", r.step)
	require.Equal(t, 0, e.pendingCommands(t, st.ID))
	require.NotNil(t, r.check, "a running saga whose next_check_at is NULL is never looked at by the rescuer: %s", r)

	e.stepToRescue(t, eng, st.ID, 250*time.Millisecond, 20*time.Second)
	waitFor(t, "the nap's timer", func() bool { return e.pendingCommands(t, st.ID) == 1 })
	require.NoError(t, e.clk.Advance(ctx, 2*time.Second))
	in := testkit.WaitEnded(t, eng, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, map[string]int{"b1": 1, "b2": 1, "s3": 1}, e.fx.Counts(t, st.ID))
}

// While its branches run, a parallel saga has no deadline.
func TestParallelHasNoDeadline(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	release := make(chan struct{})
	def := saga.Define("par2",
		saga.Step[order]{Name: "fan", Timeout: time.Second, Parallel: &saga.Parallel[order]{Branches: []saga.Branch[order]{
			{Name: "b1", Timeout: 30 * time.Second, Action: func(ctx context.Context, run *saga.StepRun, _ order) (any, error) {
				select {
				case <-release:
				case <-ctx.Done():
					return nil, ctx.Err()
				}
				return nil, e.fx.Record(ctx, run, "b1")
			}}}}},
		e.local("s2", time.Second))
	eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(time.Second), def)
	st, err := saga.Start(ctx, eng, def, order{}, nil)
	require.NoError(t, err)
	waitFor(t, "the branches", func() bool {
		r := e.read(t, st.ID)
		return r.waitKind != nil && *r.waitKind == "branches"
	})
	r := e.read(t, st.ID)
	require.Nil(t, r.check, "the saga row of a parallel step has no rescue deadline: %s", r)
	require.Nil(t, r.due, "the saga row of a parallel step has no rescue deadline: %s", r)
	e.requireTruth(t, eng, st.ID, r)
	close(release)
	in := testkit.WaitEnded(t, eng, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
}

// A saga queued behind a concurrency key has no rescue deadline; once
// admitted its first deadline is its first step's timeout with RescueSlack
// to spare, and its lost command is rescued after it, not before.
func TestConcurrencyQueuedThenAdmitted(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const T, slack = 3 * time.Second, time.Second
	def := saga.Define("keyed", e.local("s1", T)).WithConcurrency(1)
	client := testkit.NewEngine(t, e.Pool, e.cfg(slack), def)
	a, err := saga.Start(ctx, client, def, order{}, &saga.StartOpts{ConcurrencyKey: "k"})
	require.NoError(t, err)
	b, err := saga.Start(ctx, client, def, order{}, &saga.StartOpts{ConcurrencyKey: "k"})
	require.NoError(t, err)
	in, err := client.Get(ctx, b.ID)
	require.NoError(t, err)
	require.NotNil(t, in.Concurrency)
	require.True(t, in.Concurrency.Queued)

	rb := e.read(t, b.ID)
	t.Run("queued saga has no deadline", func(t *testing.T) {
		require.Nil(t, rb.check, "docs/concurrency-keys.md: a waiting saga \"has no rescue deadline\": %s", rb)
		assert.Nil(t, in.NextCheckAt, "Instance.NextCheckAt of a queued saga, which has no rescue deadline (row %s)", rb)
		page, err := client.List(ctx, &saga.ListOpts{Name: "keyed", Queued: true})
		require.NoError(t, err)
		require.Len(t, page.Sagas, 1)
		assert.Nil(t, page.Sagas[0].NextCheckAt, "List: NextCheckAt of a queued saga (row %s)", rb)
	})
	// A day in the queue: nothing is rescued or spent.
	require.NoError(t, e.clk.Advance(ctx, 24*time.Hour))
	res, err := client.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, 0, rescued(res), "%+v", res)
	require.Equal(t, 0, e.events(t, b.ID, saga.EventSagaRescued, ""))
	require.Equal(t, 0, e.read(t, b.ID).attempt)

	require.NoError(t, client.Cancel(ctx, a.ID, "make room"))
	waitFor(t, "b admitted", func() bool { return e.events(t, b.ID, saga.EventConcurrencyAdmitted, "") == 1 })
	admitted := e.eventAt(t, b.ID, saga.EventConcurrencyAdmitted)
	rb = e.read(t, b.ID)
	require.NotNil(t, rb.deadline)
	t.Run("admitted deadline has room", func(t *testing.T) {
		// "RescueSlack is added to each step's timeout to give a saga's
		// deadline ... a new saga's first deadline has that room too."
		require.GreaterOrEqual(t, rb.deadline.Sub(admitted), T+slack,
			"deadline of a just-admitted saga: %s after admission (first step Timeout %s, RescueSlack %s): %s", rb.deadline.Sub(admitted), T, slack, rb)
	})
	e.requireTruth(t, client, b.ID, rb)
	require.Equal(t, 1, e.deleteCommands(t, b.ID))
	e.stepToRescue(t, client, b.ID, 200*time.Millisecond, 20*time.Second)

	testkit.Start(t, client)
	fin := testkit.WaitEnded(t, client, b.ID)
	require.Equal(t, saga.StatusCompleted, fin.Status)
	require.Equal(t, 1, e.fx.Count(t, b.ID, "s1"))
}

// A paused saga is left alone by the rescuer however long it is paused;
// after Resume, a lost command is rescued (its deadline long passed).
func TestPausedThenResumed(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const T, slack = 2 * time.Second, time.Second
	def := saga.Define("paused", e.local("s1", T), e.local("s2", T))
	client := testkit.NewEngine(t, e.Pool, e.cfg(slack), def)
	st, err := saga.Start(ctx, client, def, order{}, nil)
	require.NoError(t, err)
	require.NoError(t, client.Pause(ctx, st.ID, "hold on"))
	require.NoError(t, e.clk.Advance(ctx, time.Hour))
	for i := 0; i < 3; i++ {
		res, err := client.RescueNow(ctx)
		require.NoError(t, err)
		require.Equal(t, 0, rescued(res)+res.Waiting, "the rescuer leaves paused sagas alone: %+v", res)
	}
	require.Equal(t, 0, e.events(t, st.ID, saga.EventSagaRescued, ""))
	require.Equal(t, 0, e.read(t, st.ID).attempt)
	require.Equal(t, 1, e.pendingCommands(t, st.ID))

	require.NoError(t, client.Resume(ctx, st.ID, "go on"))
	require.Equal(t, 1, e.deleteCommands(t, st.ID))
	e.stepToRescue(t, client, st.ID, 200*time.Millisecond, 10*time.Second)

	testkit.Start(t, client)
	in := testkit.WaitEnded(t, client, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, map[string]int{"s1": 1, "s2": 1}, e.fx.Counts(t, st.ID))
}

// sagatest.Clock.Advance past a deadline, with the engine given, rescues a
// saga whose command was lost; the saga then completes.
func TestClockAdvanceTriggersRescue(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const T, slack = 2 * time.Second, time.Second
	def := saga.Define("clock", e.local("s1", T))
	eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(slack), def)
	// The start's own command is lost.
	e.loseNext(t, "%/s1/forward/%", 0, 1)
	st, err := saga.Start(ctx, eng, def, order{}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, e.dropped(t, "%/s1/forward/%"))
	clk := sagatest.NewClock(e.Pool, e.Schema, eng)
	// Not far enough: nothing.
	require.NoError(t, clk.Advance(ctx, T))
	require.Equal(t, 0, e.events(t, st.ID, saga.EventSagaRescued, ""), "rescued before its deadline: %s", e.read(t, st.ID))
	require.NoError(t, clk.Advance(ctx, 2*slack+margin))
	in := testkit.WaitEnded(t, eng, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, 1, e.events(t, st.ID, saga.EventSagaRescued, ""))
	require.Equal(t, 1, e.fx.Count(t, st.ID, "s1"))
}

// More sagas whose lower bound passed than RescueBatch: one RescueNow
// rechecks them all, and still rescues the one saga past its deadline,
// whose next_check_at is the latest of all.
func TestManyRechecksAndOneLost(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const T, slack, n = 10 * time.Second, 5 * time.Second, 30
	def := saga.Define("many", e.local("s1", T))
	cfg := e.cfg(slack)
	cfg.RescueBatch = 5
	client := testkit.NewEngine(t, e.Pool, cfg, def)
	var ids []uuid.UUID
	for i := 0; i < n; i++ {
		st, err := saga.Start(ctx, client, def, order{N: i}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	// The last: its command lost, and its deadline its next_check_at (as
	// a tool forcing a rescue does it: "must clear due_at too").
	lost, err := saga.Start(ctx, client, def, order{N: n}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, e.deleteCommands(t, lost.ID))
	_, err = e.Pool.Exec(ctx, `UPDATE `+e.Table("saga_instances")+` SET due_at = NULL WHERE id = $1`, lost.ID)
	require.NoError(t, err)
	// Past every first check (start + 10s), before the others' deadlines
	// (start + 20s).
	require.NoError(t, e.clk.Advance(ctx, T+2*time.Second))
	res, err := client.RescueNow(ctx)
	require.NoError(t, err)
	t.Logf("%+v", res)
	require.Equal(t, 1, res.Redriven, "the one saga past its deadline must be rescued in this run: %+v", res)
	require.Equal(t, n, res.Rechecked, "every saga whose lower bound passed before its deadline is rechecked: %+v", res)
	require.Equal(t, 0, res.Waiting, "no saga but the lost one is past its deadline: %+v", res)
	for _, id := range ids {
		r := e.read(t, id)
		require.True(t, r.check.After(r.now), "saga %s: its next check should have moved to its deadline: %s", id, r)
	}
}

// Many lost sagas past their deadline, and RescueNow on two engines at
// once (four runs): each saga is re-driven exactly once.
func TestRescueNowOnTwoEngines(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const n = 40
	def := saga.Define("two", e.local("s1", time.Second), e.local("s2", time.Second))
	cfg := e.cfg(500 * time.Millisecond)
	cfg.RescueBatch = 7
	e1 := testkit.NewEngine(t, e.Pool, cfg, def)
	e2 := testkit.NewEngine(t, e.Pool, cfg, def)
	var ids []uuid.UUID
	for i := 0; i < n; i++ {
		st, err := saga.Start(ctx, e1, def, order{N: i}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	_, err := e.Pool.Exec(ctx, `DELETE FROM `+e.Table("outbox")+` WHERE status = 'pending'`)
	require.NoError(t, err)
	require.NoError(t, e.clk.Advance(ctx, time.Minute))
	total := saga.RescueResult{}
	for round := 0; round < 10; round++ {
		addRescues(&total, rescueAtOnce(t, ctx, e1, e2, e1, e2))
	}
	require.Equal(t, n, total.Redriven, "%+v", total)
	require.Equal(t, 0, total.FailedOver, "%+v", total)
	for _, id := range ids {
		require.Equal(t, 1, e.events(t, id, saga.EventSagaRescued, ""), "saga %s", id)
		require.Equal(t, 1, e.read(t, id).attempt)
	}
	testkit.Start(t, e1)
	testkit.Start(t, e2)
	for _, id := range ids {
		in := testkit.WaitEnded(t, e1, id)
		require.Equal(t, saga.StatusCompleted, in.Status)
		require.Equal(t, map[string]int{"s1": 1, "s2": 1}, e.fx.Counts(t, id))
	}
}

// Sagas make progress while their deadlines are forced into the past over
// and over (as a tool would, next_check_at and due_at both) and two engines'
// rescuers run all the time: a saga whose command is pending or running is
// never re-driven, and no effect is doubled.
func TestRescuerNeverRedrivesProgress(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const n, nsteps = 60, 5
	var ss []saga.Step[order]
	for i := 0; i < nsteps; i++ {
		name := fmt.Sprintf("s%d", i+1)
		ss = append(ss, saga.Step[order]{Name: name, Timeout: 5 * time.Second,
			Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
				time.Sleep(time.Duration(5+o.N%11) * time.Millisecond)
				return e.fx.Record(ctx, run, name)
			}})
	}
	def := saga.Define("busy", ss...)
	cfg := e.cfg(time.Second)
	cfg.Workers, cfg.BatchSize, cfg.RescueBatch = 3, 4, 10
	e1, _ := testkit.StartEngine(t, e.Pool, cfg, def)
	e2, _ := testkit.StartEngine(t, e.Pool, cfg, def)
	var ids []uuid.UUID
	for i := 0; i < n; i++ {
		st, err := saga.Start(ctx, e1, def, order{N: i}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	total := saga.RescueResult{}
	for _, g := range []*saga.Engine{e1, e2} {
		wg.Add(1)
		go func(g *saga.Engine) {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := e.Pool.Exec(ctx, `UPDATE `+e.Table("saga_instances")+` SET next_check_at = now() - interval '1 second', due_at = NULL
					WHERE id IN (SELECT id FROM `+e.Table("saga_instances")+` WHERE status IN ('running', 'compensating') ORDER BY id FOR UPDATE SKIP LOCKED)`); err != nil {
					t.Errorf("force: %v", err)
					return
				}
				res, err := g.RescueNow(ctx)
				if err != nil {
					t.Errorf("RescueNow: %v", err)
					return
				}
				mu.Lock()
				total.Redriven += res.Redriven
				total.FailedOver += res.FailedOver
				total.Waiting += res.Waiting
				total.Busy += res.Busy
				total.Superseded += res.Superseded
				mu.Unlock()
			}
		}(g)
	}
	for _, id := range ids {
		in := testkit.WaitEnded(t, e1, id)
		require.Equal(t, saga.StatusCompleted, in.Status)
	}
	close(stop)
	wg.Wait()
	t.Logf("rescuer while sagas progressed: %+v", total)
	for _, id := range ids {
		c := e.fx.Counts(t, id)
		for i := 1; i <= nsteps; i++ {
			require.Equal(t, 1, c[fmt.Sprintf("s%d", i)], "saga %s: %v", id, c)
		}
	}
	require.Equal(t, 0, total.Redriven, "a progressing saga was re-driven: %+v", total)
	require.Equal(t, 0, total.FailedOver, "%+v", total)
	require.Greater(t, total.Waiting+total.Busy+total.Superseded, 0, "the rescuer never looked at a saga: the test proves nothing")
	require.Zero(t, e1.Stats().Rescued+e2.Stats().Rescued)
}

// starve builds more sagas past their deadline than RescueBatch that the
// rescuer must skip (mk makes them), then one saga whose command is lost,
// started last (so its next_check_at is the latest), and checks that one
// RescueNow rescues it: "reads up to RescueBatch running or compensating
// sagas of the definitions it knows whose deadline has passed"; "the
// rescuer's query skips paused sagas".
func starve(t *testing.T, e *env, g *saga.Engine, def *saga.Definition[order], mk func(id uuid.UUID)) {
	t.Helper()
	ctx := context.Background()
	for i := 0; i < 20; i++ {
		st, err := saga.Start(ctx, g, def, order{N: i}, nil)
		require.NoError(t, err)
		if mk != nil {
			mk(st.ID)
		}
	}
}

func TestPausedSagasDoNotStarveTheRescuer(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	def := saga.Define("p", e.local("s1", time.Second))
	cfg := e.cfg(500 * time.Millisecond)
	cfg.RescueBatch = 5
	client := testkit.NewEngine(t, e.Pool, cfg, def)
	starve(t, e, client, def, func(id uuid.UUID) { require.NoError(t, client.Pause(ctx, id, "hold")) })
	lost, err := saga.Start(ctx, client, def, order{N: 99}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, e.deleteCommands(t, lost.ID))
	require.NoError(t, e.clk.Advance(ctx, time.Hour))
	var total saga.RescueResult
	for i := 0; i < 3; i++ {
		res, err := client.RescueNow(ctx)
		require.NoError(t, err)
		total.Redriven += res.Redriven
	}
	require.Equal(t, 1, total.Redriven, "20 paused sagas past their deadline kept the rescuer (RescueBatch 5) from the lost one: %s", e.read(t, lost.ID))
	require.Equal(t, 1, e.events(t, lost.ID, saga.EventSagaRescued, ""))
}

func TestForeignSagasDoNotStarveTheRescuer(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	mine := saga.Define("mine", e.local("s1", time.Second))
	theirs := saga.Define("theirs", e.local("s1", time.Second))
	cfg := e.cfg(500 * time.Millisecond)
	cfg.RescueBatch = 5
	other := testkit.NewEngine(t, e.Pool, e.cfg(500*time.Millisecond), theirs)
	client := testkit.NewEngine(t, e.Pool, cfg, mine)
	// 20 sagas of a type this engine does not know, their commands lost:
	// no engine of theirs runs.
	starve(t, e, other, theirs, func(id uuid.UUID) { e.deleteCommands(t, id) })
	lost, err := saga.Start(ctx, client, mine, order{N: 99}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, e.deleteCommands(t, lost.ID))
	require.NoError(t, e.clk.Advance(ctx, time.Hour))
	var total saga.RescueResult
	for i := 0; i < 3; i++ {
		res, err := client.RescueNow(ctx)
		require.NoError(t, err)
		total.Redriven += res.Redriven
	}
	require.Equal(t, 1, total.Redriven, "20 sagas of another type past their deadline kept the rescuer (RescueBatch 5) from its own lost saga: %s", e.read(t, lost.ID))
}

// Operator paths that put a saga back to work (Resume of a failed saga,
// Rerun of an ended one, Cancel of a waiting one) give it a deadline the
// rescuer finds: their lost command is rescued.
func TestOperatorPathsGiveADeadline(t *testing.T) {
	const slack = 500 * time.Millisecond
	t.Run("resume", func(t *testing.T) {
		ctx := context.Background()
		e := newEnv(t)
		var mu sync.Mutex
		fixed := false
		s2 := saga.Step[order]{Name: "s2", Timeout: time.Second, Retriable: true,
			Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
				mu.Lock()
				ok := fixed
				mu.Unlock()
				if !ok {
					return steps.Permanent(errors.New("broken"))
				}
				return e.fx.Record(ctx, run, "s2")
			}}
		s1 := saga.Step[order]{Name: "s1", Timeout: time.Second, Pivot: true,
			Action: func(ctx context.Context, run *saga.StepRun, _ *order) error { return e.fx.Record(ctx, run, "s1") }}
		def := saga.Define("resume", s1, s2)
		eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(slack), def)
		e.loseNext(t, "%/s2/forward/%", 1, 1)
		st, err := saga.Start(ctx, eng, def, order{}, nil)
		require.NoError(t, err)
		in := testkit.WaitEnded(t, eng, st.ID)
		require.Equal(t, saga.StatusFailed, in.Status)
		mu.Lock()
		fixed = true
		mu.Unlock()
		require.NoError(t, eng.Resume(ctx, st.ID, "fixed"))
		waitFor(t, "the resumed command lost", func() bool { return e.dropped(t, "%/s2/forward/%") == 1 })
		r := e.read(t, st.ID)
		require.Equal(t, "running", r.status)
		require.NotNil(t, r.check, "a resumed saga must have next_check_at, or the rescuer never looks at it: %s", r)
		e.stepToRescue(t, eng, st.ID, 200*time.Millisecond, 20*time.Second)
		in = testkit.WaitEnded(t, eng, st.ID)
		require.Equal(t, saga.StatusCompleted, in.Status)
		require.Equal(t, map[string]int{"s1": 1, "s2": 1}, e.fx.Counts(t, st.ID))
	})
	t.Run("rerun", func(t *testing.T) {
		ctx := context.Background()
		e := newEnv(t)
		def := saga.Define("rerun", e.local("s1", time.Second), e.local("s2", time.Second))
		eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(slack), def)
		st, err := saga.Start(ctx, eng, def, order{}, nil)
		require.NoError(t, err)
		testkit.WaitEnded(t, eng, st.ID)
		e.loseNext(t, "%/s2/forward/1", 0, 1)
		require.NoError(t, eng.Rerun(ctx, st.ID, "s2", "again"))
		waitFor(t, "the rerun's command lost", func() bool { return e.dropped(t, "%/s2/forward/1") == 1 })
		r := e.read(t, st.ID)
		require.Equal(t, "running", r.status)
		require.NotNil(t, r.check, "a rerun saga must have next_check_at: %s", r)
		e.stepToRescue(t, eng, st.ID, 200*time.Millisecond, 20*time.Second)
		in := testkit.WaitEnded(t, eng, st.ID)
		require.Equal(t, saga.StatusCompleted, in.Status)
		require.Equal(t, map[string]int{"s1": 1, "s2": 2}, e.fx.Counts(t, st.ID))
	})
	t.Run("cancel a signal wait", func(t *testing.T) {
		ctx := context.Background()
		e := newEnv(t)
		def := saga.Define("cancel", e.local("s1", time.Second),
			saga.Step[order]{Name: "await", Timeout: time.Second, Wait: saga.OnSignal("go", func(context.Context, *saga.StepRun, *order, struct{}) error { return nil })})
		eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(slack), def)
		st, err := saga.Start(ctx, eng, def, order{}, nil)
		require.NoError(t, err)
		waitFor(t, "the signal wait", func() bool {
			r := e.read(t, st.ID)
			return r.waitKind != nil && *r.waitKind == "signal"
		})
		e.loseNext(t, "%/s1/compensate/%", 0, 1)
		require.NoError(t, eng.Cancel(ctx, st.ID, "stop"))
		waitFor(t, "the compensation's command lost", func() bool { return e.dropped(t, "%/s1/compensate/%") == 1 })
		r := e.read(t, st.ID)
		require.Equal(t, "compensating", r.status)
		require.NotNil(t, r.check, "a cancelled saga that left a wait without a limit must have next_check_at: %s", r)
		e.stepToRescue(t, eng, st.ID, 200*time.Millisecond, 20*time.Second)
		in := testkit.WaitEnded(t, eng, st.ID)
		require.Equal(t, saga.StatusCompensated, in.Status)
		require.Equal(t, map[string]int{"s1": 1, "c:s1": 1}, e.fx.Counts(t, st.ID))
	})
}

// A signal wait with a time limit: healthy until the limit; its lost
// timeout command is rescued after the deadline and the limit applies once.
func TestLostSignalTimeoutCommand(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const limit = 6 * time.Second
	def := saga.Define("limit", e.local("s1", time.Second),
		saga.Step[order]{Name: "await", Timeout: time.Second,
			Wait: saga.OnSignal("go", func(context.Context, *saga.StepRun, *order, struct{}) error { return nil }).TimeoutThen(limit, nil)},
		e.local("s3", time.Second))
	eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(time.Second), def)
	st, err := saga.Start(ctx, eng, def, order{}, nil)
	require.NoError(t, err)
	waitFor(t, "the signal wait with its command", func() bool {
		r := e.read(t, st.ID)
		return r.waitKind != nil && *r.waitKind == "signal" && e.pendingCommands(t, st.ID) == 1
	})
	require.Equal(t, 1, e.deleteCommands(t, st.ID))
	var until time.Time
	require.NoError(t, e.Pool.QueryRow(ctx, `SELECT wait_until FROM `+e.Table("saga_instances")+` WHERE id = $1`, st.ID).Scan(&until))
	r := e.read(t, st.ID)
	require.NotNil(t, r.deadline, "a wait with a limit has a deadline: %s", r)
	require.False(t, r.deadline.Before(until), "deadline before the wait's end: %s, wait_until %s", r, until)
	e.stepToRescue(t, eng, st.ID, 500*time.Millisecond, 30*time.Second)
	in := testkit.WaitEnded(t, eng, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, map[string]int{"s1": 1, "s3": 1}, e.fx.Counts(t, st.ID))
	require.Equal(t, 1, e.events(t, st.ID, saga.EventWaitTimedOut, ""))
}

// A long first step, then quick ones: how late is a lost command of a
// quick step found? Config.RescueSlack: "at most the step's Timeout plus
// twice RescueSlack after it was written".
func TestLongFirstStepDelaysRescueOfLaterSteps(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const long, quick, slack = time.Hour, time.Second, time.Second
	def := saga.Define("long", e.local("s1", long), e.local("s2", quick), e.local("s3", quick))
	eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(slack), def)
	e.loseNext(t, "%/s2/forward/%", 0, 1)
	st, err := saga.Start(ctx, eng, def, order{}, nil)
	require.NoError(t, err)
	waitFor(t, "s2's command lost", func() bool { return e.dropped(t, "%/s2/forward/%") == 1 })
	require.NoError(t, e.clk.Advance(ctx, quick+2*slack+time.Second))
	res, err := eng.RescueNow(ctx)
	require.NoError(t, err)
	r := e.read(t, st.ID)
	require.Equalf(t, 1, res.Redriven, "a lost command of a step with Timeout %s (RescueSlack %s) is not rescued %s after it was written (%+v); the saga: %s",
		quick, slack, quick+2*slack+time.Second, res, r)
}

// A saga that has ended has no deadline: Instance.NextCheckAt is the
// "deadline of a running saga".
func TestEndedSagaHasNoDeadline(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	bad := saga.Step[order]{Name: "bad", Timeout: time.Second,
		Action: func(context.Context, *saga.StepRun, *order) error { return steps.Permanent(errors.New("no")) }}
	pivot := saga.Step[order]{Name: "p", Timeout: time.Second, Pivot: true,
		Action: func(ctx context.Context, run *saga.StepRun, _ *order) error { return nil }}
	badAfter := saga.Step[order]{Name: "bad", Timeout: time.Second, Retriable: true,
		Action: func(context.Context, *saga.StepRun, *order) error { return steps.Permanent(errors.New("no")) }}
	ok := saga.Define("ok", e.local("s1", time.Second))
	comp := saga.Define("comp", e.local("s1", time.Second), bad)
	fail := saga.Define("fail", pivot, badAfter)
	keyed := saga.Define("keyed", e.local("s1", time.Second)).WithConcurrency(1)
	eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(time.Second), ok, comp, fail)
	client := testkit.NewEngine(t, e.Pool, e.cfg(time.Second), keyed)
	var ids []uuid.UUID
	for _, start := range []func() (saga.Started, error){
		func() (saga.Started, error) { return saga.Start(ctx, eng, ok, order{}, nil) },
		func() (saga.Started, error) { return saga.Start(ctx, eng, comp, order{}, nil) },
		func() (saga.Started, error) { return saga.Start(ctx, eng, fail, order{}, nil) },
	} {
		st, err := start()
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	// A queued saga cancelled while it waits for its slot.
	_, err := saga.Start(ctx, client, keyed, order{}, &saga.StartOpts{ConcurrencyKey: "k"})
	require.NoError(t, err)
	q, err := saga.Start(ctx, client, keyed, order{}, &saga.StartOpts{ConcurrencyKey: "k"})
	require.NoError(t, err)
	require.NoError(t, client.Cancel(ctx, q.ID, "not needed"))
	for _, id := range ids {
		testkit.WaitEnded(t, eng, id)
	}
	ids = append(ids, q.ID)
	for _, id := range ids {
		in, err := client.Get(ctx, id)
		require.NoError(t, err)
		require.NotNil(t, in.EndedAt, "saga %s (%s) ended", id, in.Status)
		r := e.read(t, id)
		require.Nilf(t, in.NextCheckAt, "Instance.NextCheckAt of a %s saga: the deadline of a running saga; row %s", in.Status, r)
	}
}

// A saga whose command waits in the queue past its deadline (workers
// down) is counted Waiting once: its deadline moves into the future, no
// attempt is spent, and NextCheckAt reports the new deadline.
func TestWaitingMovesTheDeadline(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	def := saga.Define("w", e.local("s1", 2*time.Second))
	client := testkit.NewEngine(t, e.Pool, e.cfg(time.Second), def)
	st, err := saga.Start(ctx, client, def, order{}, nil)
	require.NoError(t, err)
	require.NoError(t, e.clk.Advance(ctx, time.Hour))
	res, err := client.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, res.Waiting, "%+v", res)
	require.Equal(t, 0, rescued(res), "%+v", res)
	r := e.read(t, st.ID)
	require.NotNil(t, r.deadline)
	require.True(t, r.deadline.After(r.now), "the deadline of a Waiting saga moves into the future: %s", r)
	e.requireTruth(t, client, st.ID, r)
	for i := 0; i < 3; i++ {
		res, err = client.RescueNow(ctx)
		require.NoError(t, err)
		require.Equal(t, saga.RescueResult{}, res, "a saga whose deadline moved is left alone: %s", e.read(t, st.ID))
	}
	require.Equal(t, 0, e.read(t, st.ID).attempt)
	require.Equal(t, 1, e.pendingCommands(t, st.ID))
}

// Steps that lower the deadline (a remote step with a short reply timeout
// after a local step with a long one) run while the rescuer rechecks the
// same sagas over and over: no saga ends up with a deadline later than its
// reply timeout.
func TestRecheckRacesRemoteSteps(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const n, remoteT, slack = 40, 4 * time.Second, time.Second
	pay := saga.Step[order]{Name: "pay", Timeout: remoteT, Remote: &saga.Remote[order]{Topic: "payments.commands", Type: "payments.charge",
		Command: func(context.Context, *saga.StepRun, *order) (any, error) { return map[string]int{"amount": 1}, nil }}}
	s1 := saga.Step[order]{Name: "s1", Timeout: 10 * time.Second,
		Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
			time.Sleep(time.Duration(o.N%5) * time.Millisecond)
			return e.fx.Record(ctx, run, "s1")
		}}
	def := saga.Define("race", s1, pay)
	cfg := e.cfg(slack)
	cfg.Kafka = &saga.KafkaConfig{NewReader: testkit.NewSilentReader}
	client := testkit.NewEngine(t, e.Pool, cfg, def)
	var ids []uuid.UUID
	for i := 0; i < n; i++ {
		st, err := saga.Start(ctx, client, def, order{N: i}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	// Every first check passes (start + 10s) before the deadline (+12s).
	require.NoError(t, e.clk.Advance(ctx, 11*time.Second))
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := client.RescueNow(ctx); err != nil {
				t.Errorf("RescueNow: %v", err)
				return
			}
		}
	}()
	testkit.Start(t, client)
	waitFor(t, "every remote command sent", func() bool {
		return e.Count(t, `SELECT count(*) FROM `+e.Table("saga_history")+` WHERE event = 'command_sent'`) == n
	})
	close(stop)
	wg.Wait()
	for _, id := range ids {
		sent := e.eventAt(t, id, saga.EventCommandSent)
		r := e.read(t, id)
		require.NotNil(t, r.deadline)
		require.LessOrEqualf(t, r.deadline.Sub(sent), remoteT+margin, "saga %s: reply deadline %s after sending, want its Timeout %s: %s", id, r.deadline.Sub(sent), remoteT, r)
		require.NotNil(t, r.check)
		require.False(t, r.check.After(*r.deadline), "next_check_at above the deadline: %s", r)
	}
}

func payStep(timeout time.Duration, compensate bool, retry *saga.RetryPolicy) saga.Step[order] {
	r := &saga.Remote[order]{Topic: "payments.commands", Type: "payments.charge",
		Command: func(context.Context, *saga.StepRun, *order) (any, error) { return map[string]int{"amount": 1}, nil }}
	if compensate {
		r.CompensateType = "payments.refund"
	}
	return saga.Step[order]{Name: "pay", Timeout: timeout, Remote: r, CompensateRetry: retry}
}

// publishRelayRows marks saga id's pending relay rows published, as a relay
// would, and returns how many.
func (e *env) publishRelayRows(t *testing.T, id uuid.UUID) int {
	t.Helper()
	tag, err := e.Pool.Exec(context.Background(), `UPDATE `+e.Table("outbox")+` SET status = 'published', published_at = now() WHERE saga_id = $1 AND status = 'pending' AND delivery = 'relay'`, id)
	require.NoError(t, err)
	return int(tag.RowsAffected())
}

// A saga whose first step is remote: its first check is the step's
// timeout away, its deadline twice RescueSlack later; once the command is
// sent, the reply deadline is exactly the Timeout after sending.
func TestFirstStepRemote(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const remoteT, slack = 3 * time.Second, 2 * time.Second
	def := saga.Define("first-remote", payStep(remoteT, false, nil), e.local("s2", time.Second))
	cfg := e.cfg(slack)
	cfg.Kafka = &saga.KafkaConfig{NewReader: testkit.NewSilentReader}
	eng, _ := testkit.StartEngine(t, e.Pool, cfg, def)
	st, err := saga.Start(ctx, eng, def, order{}, nil)
	require.NoError(t, err)
	waitFor(t, "the remote command sent", func() bool { return e.events(t, st.ID, saga.EventCommandSent, "") == 1 })
	require.Equal(t, 1, e.publishRelayRows(t, st.ID))
	sent := e.eventAt(t, st.ID, saga.EventCommandSent)
	r := e.read(t, st.ID)
	within(t, "reply deadline - command sent", r.deadline.Sub(sent), remoteT-sentSkew, remoteT+margin)
	e.stepToRescue(t, eng, st.ID, 250*time.Millisecond, 20*time.Second)
	in := testkit.WaitEnded(t, eng, st.ID)
	require.Equal(t, saga.StatusCompensated, in.Status)
}

// A remote compensation with no reply is sent again under the same key at
// each deadline (its Timeout), never before, until CompensateRetry's
// attempts are spent; then the saga is failed.
func TestRemoteCompensationResentAtEachDeadline(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const remoteT, slack, tries = 2 * time.Second, time.Second, 3
	def := saga.Define("refund", e.local("s1", time.Second), payStep(remoteT, true, &saga.RetryPolicy{MaxAttempts: tries}))
	cfg := e.cfg(slack)
	cfg.Kafka = &saga.KafkaConfig{NewReader: testkit.NewSilentReader}
	eng, _ := testkit.StartEngine(t, e.Pool, cfg, def)
	st, err := saga.Start(ctx, eng, def, order{}, nil)
	require.NoError(t, err)
	cycles := 0
	for cycles < 10 {
		waitFor(t, "a remote command to send", func() bool {
			return e.Count(t, `SELECT count(*) FROM `+e.Table("outbox")+` WHERE saga_id = $1 AND status = 'pending' AND delivery = 'relay'`, st.ID) == 1 ||
				e.read(t, st.ID).status == "failed"
		})
		if e.read(t, st.ID).status == "failed" {
			break
		}
		require.Equal(t, 1, e.publishRelayRows(t, st.ID))
		sent := e.eventAt(t, st.ID, saga.EventCommandSent)
		r := e.read(t, st.ID)
		within(t, fmt.Sprintf("cycle %d: reply deadline - command sent", cycles), r.deadline.Sub(sent), remoteT-sentSkew, remoteT+margin)
		e.stepToRescue(t, eng, st.ID, 250*time.Millisecond, 20*time.Second)
		cycles++
	}
	in := testkit.WaitEnded(t, eng, st.ID)
	require.Equal(t, saga.StatusFailed, in.Status)
	require.Equal(t, 1+tries, cycles, "one forward send, then %d compensation sends", tries)
	require.Equal(t, map[string]int{"s1": 1}, e.fx.Counts(t, st.ID))
}

// The rescuer never waits for a running step ("taking each one's advisory
// lock without waiting (a saga whose lock is held has a step running: it
// is alive)"). Here saga A's step has completed inside a batch that is
// still running B's slow step, so A's row is locked until that batch
// commits; A's lower bound has passed. RescueNow must not wait for the
// batch.
func TestRecheckDoesNotWaitForARunningBatch(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const slow = 4 * time.Second
	inB := make(chan struct{}, 1)
	s1 := saga.Step[order]{Name: "s1", Timeout: 10 * time.Second,
		Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
			if o.N == 1 {
				// Its first statement sends A's queued outcome.
				if _, err := run.Tx.Exec(ctx, `SELECT 1`); err != nil {
					return err
				}
				inB <- struct{}{}
				select {
				case <-time.After(slow):
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			return e.fx.Record(ctx, run, "s1")
		}}
	def := saga.Define("batch", s1, e.local("s2", time.Second))
	cfg := e.cfg(5 * time.Second)
	cfg.Workers, cfg.BatchSize = 1, 16
	eng := testkit.NewEngine(t, e.Pool, cfg, def)
	a, err := saga.Start(ctx, eng, def, order{N: 0}, nil)
	require.NoError(t, err)
	_, err = saga.Start(ctx, eng, def, order{N: 1}, nil)
	require.NoError(t, err)
	// Past both first checks (start + 10s), before their deadlines (+20s).
	require.NoError(t, e.clk.Advance(ctx, 11*time.Second))
	testkit.Start(t, eng)
	testkit.Recv(t, inB, 10*time.Second, "B's slow step")
	// A's row is locked by the batch now, if A was in it.
	locked := e.Count(t, `SELECT count(*) FROM `+e.Table("effects")+` WHERE saga_id = $1`, a.ID) == 0
	began := time.Now()
	res, err := eng.RescueNow(ctx)
	took := time.Since(began)
	require.NoError(t, err)
	t.Logf("RescueNow took %s: %+v (A in B's batch: %v)", took, res, locked)
	require.Less(t, took, slow/2, "RescueNow waited %s for a batch running a slow step (its recheck of a saga whose row the batch holds)", took)
}

// More sagas past their deadline whose steps are running (Busy) than
// RescueBatch, and one lost saga whose deadline passed later: the busy
// ones must not keep the rescuer from the lost one.
func TestBusySagasDoNotStarveTheRescuer(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	release := make(chan struct{})
	var entered sync.WaitGroup
	const busy = 8
	entered.Add(busy)
	s1 := saga.Step[order]{Name: "s1", Timeout: 30 * time.Second,
		Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
			if o.N < busy {
				entered.Done()
				select {
				case <-release:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			return e.fx.Record(ctx, run, "s1")
		}}
	def := saga.Define("slow", s1)
	cfg := e.cfg(time.Second)
	cfg.Workers, cfg.BatchSize, cfg.RescueBatch = busy, 1, 5
	cfg.HandlerGrace = time.Minute
	eng, _ := testkit.StartEngine(t, e.Pool, cfg, def)
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	var ids []uuid.UUID
	for i := 0; i < busy; i++ {
		st, err := saga.Start(ctx, eng, def, order{N: i}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	entered.Wait()
	e.loseNext(t, "%/s1/forward/%", 0, 1)
	lost, err := saga.Start(ctx, eng, def, order{N: 99}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, e.dropped(t, "%/s1/forward/%"))
	// Deadlines into the past, as a tool does it (both columns): the busy
	// ones an hour ago, the lost one a minute ago.
	_, err = e.Pool.Exec(ctx, `UPDATE `+e.Table("saga_instances")+` SET next_check_at = now() - interval '1 hour', due_at = NULL WHERE id = ANY($1)`, ids)
	require.NoError(t, err)
	_, err = e.Pool.Exec(ctx, `UPDATE `+e.Table("saga_instances")+` SET next_check_at = now() - interval '1 minute', due_at = NULL WHERE id = $1`, lost.ID)
	require.NoError(t, err)
	var total saga.RescueResult
	for i := 0; i < 3; i++ {
		res, err := eng.RescueNow(ctx)
		require.NoError(t, err)
		t.Logf("run %d: %+v", i, res)
		total.Redriven += res.Redriven
		total.Busy += res.Busy
	}
	require.Greater(t, total.Busy, 0, "the busy sagas were not seen as busy: the test proves nothing")
	require.Equal(t, 1, total.Redriven, "%d sagas with running steps past their deadline kept the rescuer (RescueBatch 5) from the lost saga: %s", busy, e.read(t, lost.ID))
	close(release)
	in := testkit.WaitEnded(t, eng, lost.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
}

// MigrateSagas moves a saga that waits without a time limit (no deadline)
// to a step that has a command: the saga must get a deadline the rescuer
// finds, or a lost command there is never rescued.
func TestMigratedWaitGetsADeadline(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	await := saga.Step[order]{Name: "await", Timeout: time.Second,
		Wait: saga.OnSignal("go", func(context.Context, *saga.StepRun, *order, struct{}) error { return nil })}
	v1 := saga.Define("mig", e.local("s1", time.Second), await)
	v2 := saga.Define("mig", e.local("s1", time.Second), await,
		saga.Step[order]{Name: "nap", Timeout: time.Second, Wait: saga.Sleep[order](time.Second)}, e.local("s4", time.Second)).WithVersion(2)
	eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(500*time.Millisecond), v1, v2)
	st, err := saga.Start(ctx, eng, v1, order{}, nil)
	require.NoError(t, err)
	waitFor(t, "the signal wait", func() bool {
		r := e.read(t, st.ID)
		return r.waitKind != nil && *r.waitKind == "signal"
	})
	e.waitNoDeadline(t, eng, st.ID)
	e.loseNext(t, "%/nap/forward/%", 0, 1)
	res, err := saga.MigrateSagas(ctx, eng, saga.Migration[order, order]{From: v1, To: v2,
		Map: func(_ context.Context, _ uuid.UUID, s *order, _ saga.Position) (*order, saga.Position, error) {
			return s, saga.Position{Step: "nap", Direction: steps.Forward}, nil
		}}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, res.Moved, "%+v", res)
	waitFor(t, "nap's command lost", func() bool { return e.dropped(t, "%/nap/forward/%") == 1 })
	r := e.read(t, st.ID)
	require.Equal(t, "nap", r.step)
	require.Equal(t, 0, e.pendingCommands(t, st.ID))
	require.NotNil(t, r.check, "a migrated saga with a lost command and next_check_at NULL is never looked at: %s", r)
	e.stepToRescue(t, eng, st.ID, 200*time.Millisecond, 20*time.Second)
	waitFor(t, "the nap's timer", func() bool { return e.pendingCommands(t, st.ID) == 1 })
	require.NoError(t, e.clk.Advance(ctx, 2*time.Second))
	in := testkit.WaitEnded(t, eng, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, map[string]int{"s1": 1, "s4": 1}, e.fx.Counts(t, st.ID))
}

// A step whose retries ran out pauses its saga (PauseWhenExhausted); Resume
// runs it again. A lost command then is still rescued.
func TestPauseWhenExhaustedThenResume(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	var mu sync.Mutex
	fixed := false
	// Two attempts, so that the rescue of the lost command (which counts
	// one) does not spend them: TestRescueExhaustionKeepsStepRules is about
	// that.
	s2 := saga.Step[order]{Name: "s2", Timeout: time.Second, PauseWhenExhausted: true,
		Retry: &saga.RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return 10 * time.Millisecond }},
		Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
			mu.Lock()
			ok := fixed
			mu.Unlock()
			if !ok {
				return errors.New("down")
			}
			return e.fx.Record(ctx, run, "s2")
		}}
	def := saga.Define("exhaust", e.local("s1", time.Second), s2)
	eng, stop := testkit.StartEngine(t, e.Pool, e.cfg(500*time.Millisecond), def)
	st, err := saga.Start(ctx, eng, def, order{}, nil)
	require.NoError(t, err)
	waitFor(t, "the pause", func() bool { return e.events(t, st.ID, saga.EventSagaPaused, "") == 1 })
	stop()
	client := testkit.NewEngine(t, e.Pool, e.cfg(500*time.Millisecond), def)
	require.NoError(t, e.clk.Advance(ctx, time.Hour))
	res, err := client.RescueNow(ctx)
	require.NoError(t, err)
	require.Equal(t, 0, rescued(res), "a paused saga is left alone: %+v", res)
	mu.Lock()
	fixed = true
	mu.Unlock()
	require.NoError(t, client.Resume(ctx, st.ID, "fixed"))
	require.Equal(t, 1, e.deleteCommands(t, st.ID), "the resumed step's command")
	r := e.read(t, st.ID)
	require.Equal(t, "running", r.status)
	require.NotNil(t, r.deadline, "a resumed saga has a deadline: %s", r)
	e.stepToRescue(t, client, st.ID, 200*time.Millisecond, 20*time.Second)
	testkit.Start(t, client)
	in := testkit.WaitEnded(t, client, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, map[string]int{"s1": 1, "s2": 1}, e.fx.Counts(t, st.ID))
}

// A lost command of a step whose attempts the rescue spends: the rescue's
// fail-over must keep the step's own rules. PauseWhenExhausted: "pauses the
// saga ... when Action's retries are spent ..., instead of compensating";
// Retriable (after the pivot): "retried past its MaxAttempts ... until it
// succeeds, and never compensated".
func TestRescueExhaustionKeepsStepRules(t *testing.T) {
	for _, tc := range []struct {
		name string
		skip int
		step func(e *env) saga.Step[order]
	}{
		{name: "pause when exhausted", step: func(e *env) saga.Step[order] {
			s := e.local("s2", time.Second)
			s.Compensate = nil
			s.PauseWhenExhausted, s.Retry = true, &saga.RetryPolicy{MaxAttempts: 1}
			return s
		}},
		{name: "pause when exhausted, last retry lost", skip: 2, step: func(e *env) saga.Step[order] {
			return saga.Step[order]{Name: "s2", Timeout: time.Second, PauseWhenExhausted: true,
				Retry: &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return 10 * time.Millisecond }},
				Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
					if run.Attempt < 3 {
						return errors.New("flaky")
					}
					return e.fx.Record(ctx, run, "s2")
				}}
		}},
		{name: "retriable after pivot", step: func(e *env) saga.Step[order] {
			s := e.local("s2", time.Second)
			s.Compensate = nil
			s.Retriable, s.Retry = true, &saga.RetryPolicy{MaxAttempts: 1}
			return s
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			e := newEnv(t)
			s1 := e.local("s1", time.Second)
			if tc.name == "retriable after pivot" {
				s1.Pivot, s1.Compensate = true, nil
			}
			def := saga.Define("rules", s1, tc.step(e))
			eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(500*time.Millisecond), def)
			e.loseNext(t, "%/s2/forward/%", tc.skip, 1)
			st, err := saga.Start(ctx, eng, def, order{}, nil)
			require.NoError(t, err)
			waitFor(t, "s2's command lost", func() bool { return e.dropped(t, "%/s2/forward/%") == 1 })
			require.Equal(t, tc.skip, e.events(t, st.ID, saga.EventStepFailed, "s2"))
			require.NoError(t, e.clk.Advance(ctx, time.Hour))
			res, err := eng.RescueNow(ctx)
			require.NoError(t, err)
			t.Logf("%+v", res)
			r := e.read(t, st.ID)
			in, err := eng.Get(ctx, st.ID)
			require.NoError(t, err)
			switch tc.name {
			case "pause when exhausted", "pause when exhausted, last retry lost":
				require.Truef(t, in.Paused != nil || (r.status == "running" && res.Redriven == 1),
					"the rescue spent s2's last attempt: the saga must pause (or be re-driven), not compensate: %s, paused %v, %+v", r, in.Paused, res)
			default:
				// Re-driven, the running engine may have run s2 and
				// completed the saga before it is read here.
				require.Truef(t, (r.status == "running" || r.status == "completed") && res.Redriven == 1,
					"a Retriable step after the pivot must be re-driven, never compensated or failed: %s, %+v", r, res)
			}
		})
	}
}

// Two engines recheck the same sagas at once: each saga is rechecked once
// in all (Rechecked is not double counted) and no deadline moves.
func TestConcurrentRechecks(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const n = 30
	def := saga.Define("rc", e.local("s1", 10*time.Second))
	cfg := e.cfg(5 * time.Second)
	e1 := testkit.NewEngine(t, e.Pool, cfg, def)
	e2 := testkit.NewEngine(t, e.Pool, cfg, def)
	var ids []uuid.UUID
	before := map[uuid.UUID]time.Time{}
	for i := 0; i < n; i++ {
		st, err := saga.Start(ctx, e1, def, order{N: i}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	require.NoError(t, e.clk.Advance(ctx, 12*time.Second))
	for _, id := range ids {
		before[id] = *e.read(t, id).deadline
	}
	total := rescueAtOnce(t, ctx, e1, e2, e1, e2)
	require.Equal(t, n, total.Rechecked, "%+v", total)
	require.Equal(t, 0, total.Redriven+total.Waiting, "%+v", total)
	for _, id := range ids {
		r := e.read(t, id)
		require.WithinDuration(t, before[id], *r.deadline, time.Millisecond, "a recheck moved the deadline: %s", r)
		require.WithinDuration(t, *r.deadline, *r.check, time.Millisecond, "next_check_at moved up to due_at: %s", r)
	}
}

// Kafka mode: a step command published to the bus and never consumed (the
// reader delivers nothing) is lost; the rescuer re-drives it after the
// deadline, not before, and writes it to the outbox again.
func TestKafkaModeLostPublishedCommand(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	const T, slack = 2 * time.Second, time.Second
	def := saga.Define("km", e.local("s1", T))
	cfg := e.cfg(slack)
	cfg.Kafka = &saga.KafkaConfig{AllSteps: true, NewReader: testkit.NewSilentReader}
	eng, _ := testkit.StartEngine(t, e.Pool, cfg, def)
	st, err := saga.Start(ctx, eng, def, order{}, nil)
	require.NoError(t, err)
	require.Equal(t, 1, e.publishRelayRows(t, st.ID), "Kafka mode writes the command as a relay row")
	e.stepToRescue(t, eng, st.ID, 200*time.Millisecond, 20*time.Second)
	require.Equal(t, 1, e.Count(t, `SELECT count(*) FROM `+e.Table("outbox")+` WHERE saga_id = $1 AND status = 'pending' AND delivery = 'relay'`, st.ID),
		"the re-drive writes the command for the relay again")
	r := e.read(t, st.ID)
	require.Equal(t, 1, r.attempt)
	require.Equal(t, "running", r.status)
}

// A parallel group's saga row has no deadline; a branch is "a step of its
// own". When a branch's command is lost, is the saga left behind?
// Guarantee 9: "Every running saga has a deadline ... The rescuer finds
// sagas past the deadline: ... one whose command was lost is re-driven".
func TestLostBranchCommand(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	branch := func(name string) saga.Branch[order] {
		return saga.Branch[order]{Name: name, Timeout: time.Second,
			Action: func(ctx context.Context, run *saga.StepRun, _ order) (any, error) {
				return nil, e.fx.Record(ctx, run, name)
			}}
	}
	def := saga.Define("lostbranch",
		saga.Step[order]{Name: "fan", Timeout: time.Second, Parallel: &saga.Parallel[order]{Branches: []saga.Branch[order]{branch("b1"), branch("b2")}}},
		e.local("s2", time.Second))
	eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(time.Second), def)
	e.loseNext(t, "%/fan.b2/forward/%", 0, 1)
	st, err := saga.Start(ctx, eng, def, order{}, nil)
	require.NoError(t, err)
	waitFor(t, "b2's command lost and b1 done", func() bool {
		return e.dropped(t, "%/fan.b2/forward/%") == 1 && e.fx.Count(t, st.ID, "b1") == 1
	})
	r := e.read(t, st.ID)
	require.Equal(t, 0, e.pendingCommands(t, st.ID), "b2's command is gone: %s", r)
	// A day passes; the rescuer runs.
	for i := 0; i < 4; i++ {
		require.NoError(t, e.clk.Advance(ctx, 6*time.Hour))
		_, err := eng.RescueNow(ctx)
		require.NoError(t, err)
	}
	in, err := eng.Get(ctx, st.ID)
	require.NoError(t, err)
	branches, err := eng.Branches(ctx, st.ID)
	require.NoError(t, err)
	r = e.read(t, st.ID)
	require.Truef(t, in.EndedAt != nil || e.fx.Count(t, st.ID, "b2") == 1 || e.pendingCommands(t, st.ID) > 0,
		"a day after a branch's command was lost the saga is still waiting for it with nothing to wake it and no deadline: %s, branches %+v", r, branches)
	// Its command sent again (RescueResult.Redriven), b2 runs, the group
	// joins and the saga completes, each branch and step once.
	waitFor(t, "the saga to complete after b2's command was sent again", func() bool { return e.read(t, st.ID).status == "completed" })
	for _, name := range []string{"b1", "b2", "s2"} {
		require.Equal(t, 1, e.fx.Count(t, st.ID, name), name)
	}
	branches, err = eng.Branches(ctx, st.ID)
	require.NoError(t, err)
	for _, b := range branches {
		require.Equal(t, "completed", b.Status, b.Branch)
	}
}

// A saga waiting for a signal without a time limit has no deadline "as
// what it waits for wakes it". The signal's wake-up is a command: when it
// is lost, is the saga left behind with its signal pending?
func TestLostSignalWakeUp(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	def := saga.Define("lostwake", e.local("s1", time.Second),
		saga.Step[order]{Name: "await", Timeout: time.Second, Wait: saga.OnSignal("go", func(context.Context, *saga.StepRun, *order, struct{}) error { return nil })},
		e.local("s3", time.Second))
	eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(time.Second), def)
	st, err := saga.Start(ctx, eng, def, order{}, nil)
	require.NoError(t, err)
	waitFor(t, "the signal wait", func() bool {
		r := e.read(t, st.ID)
		return r.waitKind != nil && *r.waitKind == "signal" && e.pendingCommands(t, st.ID) == 0
	})
	e.loseNext(t, "type:sagaflow.wake", 0, 1)
	_, err = eng.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "go", Payload: struct{}{}})
	require.NoError(t, err)
	waitFor(t, "the wake-up lost", func() bool { return e.dropped(t, "type:sagaflow.wake") == 1 })
	for i := 0; i < 4; i++ {
		require.NoError(t, e.clk.Advance(ctx, 6*time.Hour))
		_, err := eng.RescueNow(ctx)
		require.NoError(t, err)
	}
	r := e.read(t, st.ID)
	sigs, err := eng.Signals(ctx, st.ID)
	require.NoError(t, err)
	require.Truef(t, e.fx.Count(t, st.ID, "s3") == 1 || e.pendingCommands(t, st.ID) > 0,
		"a day after its signal's wake-up was lost the saga still waits, with no deadline, its signal pending: %s, signals %+v", r, sigs)
	// Woken again (RescueResult.Woken), it takes its signal and completes,
	// each step once.
	waitFor(t, "the saga to complete after its new wake-up", func() bool { return e.read(t, st.ID).status == "completed" })
	require.Equal(t, 1, e.fx.Count(t, st.ID, "s3"))
	sigs, err = eng.Signals(ctx, st.ID)
	require.NoError(t, err)
	require.Len(t, sigs, 1)
	require.Equal(t, "delivered", string(sigs[0].Status))
}

// The same for a child wait without a time limit: the child's end wakes the
// parent with a command; when that command is lost, is the parent left
// behind?
func TestLostChildWakeUp(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	child := saga.Define("kid", e.local("k1", time.Second))
	parent := saga.Define("parent", e.local("s1", time.Second),
		saga.Step[order]{Name: "spawn", Timeout: time.Second, Wait: saga.Child(child,
			func(context.Context, *saga.StepRun, *order) (order, *saga.StartOpts, error) {
				return order{N: 7}, nil, nil
			},
			func(context.Context, *saga.StepRun, *order, order) error { return nil })},
		e.local("s3", time.Second))
	eng, _ := testkit.StartEngine(t, e.Pool, e.cfg(time.Second), parent, child)
	e.loseNext(t, "type:sagaflow.wake", 0, 1)
	st, err := saga.Start(ctx, eng, parent, order{}, nil)
	require.NoError(t, err)
	waitFor(t, "the child's wake-up lost", func() bool { return e.dropped(t, "type:sagaflow.wake") == 1 })
	for i := 0; i < 4; i++ {
		require.NoError(t, e.clk.Advance(ctx, 6*time.Hour))
		_, err := eng.RescueNow(ctx)
		require.NoError(t, err)
	}
	r := e.read(t, st.ID)
	kids := e.Count(t, `SELECT count(*) FROM `+e.Table("saga_instances")+` WHERE parent_id = $1 AND status = 'completed'`, st.ID)
	require.Truef(t, e.fx.Count(t, st.ID, "s3") == 1 || e.pendingCommands(t, st.ID) > 0,
		"a day after its completed child's (%d) wake-up was lost the parent still waits, with no deadline: %s", kids, r)
	waitFor(t, "the parent to complete after its new wake-up", func() bool { return e.read(t, st.ID).status == "completed" })
	require.Equal(t, 1, e.fx.Count(t, st.ID, "s3"))
}

// Rows written before migration 013 have due_at NULL: "their deadline is
// next_check_at, as it was". A lost command of such a saga is rescued at
// next_check_at, without a recheck, and not before.
func TestPre013Rows(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	def := saga.Define("old", e.local("s1", time.Second))
	client := testkit.NewEngine(t, e.Pool, e.cfg(time.Second), def)
	st, err := saga.Start(ctx, client, def, order{}, nil)
	require.NoError(t, err)
	_, err = e.Pool.Exec(ctx, `UPDATE `+e.Table("saga_instances")+` SET due_at = NULL, next_check_at = clock_timestamp() + interval '5 seconds' WHERE id = $1`, st.ID)
	require.NoError(t, err)
	require.Equal(t, 1, e.deleteCommands(t, st.ID))
	r := e.read(t, st.ID)
	require.WithinDuration(t, *r.check, *r.deadline, time.Millisecond)
	// The deadline was set in real time: the time that passes for real
	// while the clock is stepped counts too (a run beside other tests on
	// this 2-core machine spent 0.75 s of it).
	began := time.Now()
	advanced, _ := e.stepToRescue(t, client, st.ID, 250*time.Millisecond, 20*time.Second)
	within(t, "time to the rescue of a pre-013 row", advanced+time.Since(began), 4500*time.Millisecond, 5500*time.Millisecond)
	testkit.Start(t, client)
	in := testkit.WaitEnded(t, client, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, 1, e.fx.Count(t, st.ID, "s1"))
}

// rescueAtOnce runs RescueNow on each of engines at the same time and
// returns the sum of what they did.
func rescueAtOnce(t *testing.T, ctx context.Context, engines ...*saga.Engine) saga.RescueResult {
	t.Helper()
	var mu sync.Mutex
	var total saga.RescueResult
	var wg sync.WaitGroup
	for _, g := range engines {
		wg.Add(1)
		go func(g *saga.Engine) {
			defer wg.Done()
			res, err := g.RescueNow(ctx)
			if err != nil {
				t.Errorf("RescueNow: %v", err)
				return
			}
			mu.Lock()
			addRescues(&total, res)
			mu.Unlock()
		}(g)
	}
	wg.Wait()
	return total
}

// addRescues adds r's counts to total.
func addRescues(total *saga.RescueResult, r saga.RescueResult) {
	total.Redriven += r.Redriven
	total.FailedOver += r.FailedOver
	total.Waiting += r.Waiting
	total.Busy += r.Busy
	total.Superseded += r.Superseded
	total.Deadlines += r.Deadlines
	total.Released += r.Released
	total.Woken += r.Woken
	total.Rechecked += r.Rechecked
}
