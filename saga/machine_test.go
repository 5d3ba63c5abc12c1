package saga

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/steps"
)

// The state machine's table tests: every decision, from a saga row, a
// definition and an outcome, without PostgreSQL.

const testSlack = 3 * time.Minute

var testMachine = machine{slack: testSlack, maxState: 64}

type noState struct{}

func noop(context.Context, *StepRun, *noState) error { return nil }

// testDef is a saga of four local steps: reserve and charge compensate,
// notify does not, ship does. Actions are retried three times, one second
// per attempt apart; compensations twice, a minute apart.
func testDef(t *testing.T) *compiled {
	t.Helper()
	retry := &RetryPolicy{MaxAttempts: 3, Backoff: func(attempt int) time.Duration { return time.Duration(attempt) * time.Second }}
	comp := &RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return time.Minute }}
	step := func(name string, timeout time.Duration, compensate bool) Step[noState] {
		s := Step[noState]{Name: name, Action: noop, Timeout: timeout, Retry: retry, CompensateRetry: comp}
		if compensate {
			s.Compensate = noop
		}
		return s
	}
	c, err := Define("order",
		step("reserve", 10*time.Second, true),
		step("charge", 20*time.Second, true),
		step("notify", 30*time.Second, false),
		step("ship", 40*time.Second, true),
	).compile()
	require.NoError(t, err)
	return c
}

// remoteDef is a saga whose middle step, pay, is a call to another service
// that is compensated locally.
func remoteDef(t *testing.T) *compiled {
	t.Helper()
	c, err := Define("checkout",
		Step[noState]{Name: "reserve", Action: noop, Compensate: noop, Timeout: 10 * time.Second},
		Step[noState]{Name: "pay", Compensate: noop, Timeout: 20 * time.Second,
			Retry: &RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return time.Second }},
			Remote: &Remote[noState]{Topic: "payments", Type: "pay",
				Command: func(context.Context, *StepRun, *noState) (any, error) { return nil, nil }}},
		Step[noState]{Name: "ship", Action: noop, Timeout: 30 * time.Second},
	).compile()
	require.NoError(t, err)
	return c
}

var testSagaID = uuid.MustParse("0190a000-0000-7000-8000-000000000001")

// at is a saga of def at step in direction dir, with status, in run 2 at
// version 7, after attempts attempts of the step.
func at(def *compiled, step string, dir steps.Direction, status string, attempts int) *store.Saga {
	return &store.Saga{ID: testSagaID, Name: def.name, Status: status, StepIndex: def.byName[step], StepName: step,
		Direction: string(dir), Epoch: 2, Attempt: attempts, Version: 7}
}

// outcome is what a test compares of a decision.
type outcome struct {
	Status, Step string
	Dir          steps.Direction
	Attempt      int
	CheckAfter   time.Duration
	Next         *nextCommand
	Retry        bool
	Events       []string // the history's events, in order
	Code         string   // the last error's code; "" for none
	FailedStep   string
	ClearCancel  bool
	Awaiting     bool
}

func summary(d decision) outcome {
	tr := d.tr
	o := outcome{Status: tr.Status, Step: tr.StepName, Dir: steps.Direction(tr.Direction), Attempt: tr.Attempt,
		CheckAfter: tr.CheckAfter, Next: d.next, Retry: d.retry, Code: deref(tr.LastErrorCode),
		FailedStep: deref(tr.FailedStep), ClearCancel: tr.ClearCancel, Awaiting: tr.AwaitingReply}
	for _, h := range tr.History {
		o.Events = append(o.Events, h.Event)
	}
	return o
}

func next(step string, dir steps.Direction, epoch int, delay time.Duration) *nextCommand {
	return &nextCommand{step: step, dir: dir, epoch: epoch, delay: delay}
}

const (
	fwd  = steps.Forward
	comp = steps.Compensate
)

func TestMachineSuccess(t *testing.T) {
	t.Parallel()
	def := testDef(t)
	for _, tc := range []struct {
		name string
		sg   *store.Saga
		want outcome
	}{
		{"forward: the next step runs", at(def, "reserve", fwd, store.StatusRunning, 1), outcome{
			Status: store.StatusRunning, Step: "charge", Dir: fwd, CheckAfter: 20*time.Second + testSlack,
			Next: next("charge", fwd, 2, 0), Events: []string{EventStepCompleted}}},
		{"forward, the last step: the saga completes", at(def, "ship", fwd, store.StatusRunning, 0), outcome{
			Status: store.StatusCompleted, Step: "ship", Dir: fwd,
			Events: []string{EventStepCompleted, EventSagaCompleted}}},
		{"compensating: the previous step with a compensation is undone", at(def, "ship", comp, store.StatusCompensating, 1), outcome{
			Status: store.StatusCompensating, Step: "charge", Dir: comp, CheckAfter: 20*time.Second + testSlack,
			Next: next("charge", comp, 2, 0), Events: []string{EventCompensationCompleted}}},
		{"the first step's compensation: the compensation ends", at(def, "reserve", comp, store.StatusCompensating, 0), outcome{
			Status: store.StatusCompensated, Step: "reserve", Dir: comp,
			Events: []string{EventCompensationCompleted, EventSagaCompensated}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			idx := def.byName[tc.sg.StepName]
			d := testMachine.success(tc.sg, def, idx, steps.Direction(tc.sg.Direction), []byte(`{"n":1}`), 5*time.Millisecond, "key")
			require.Equal(t, tc.want, summary(d))
			require.JSONEq(t, `{"n":1}`, string(d.tr.State))
			require.Equal(t, "key", d.tr.InboxKey)
			require.Equal(t, store.InboxConsumerEngine, d.tr.InboxConsumer)
			require.Equal(t, tc.sg.Attempt+1, d.tr.History[0].Attempt)
			require.Equal(t, tc.sg.Version, d.tr.Version, "the fence is the version the saga was read at")
		})
	}

	t.Run("forward success clears the last error", func(t *testing.T) {
		t.Parallel()
		sg := at(def, "charge", fwd, store.StatusRunning, 1)
		msg, code, step := "boom", CodeError, "charge"
		sg.LastError, sg.LastErrorCode, sg.FailedStep = &msg, &code, &step
		d := testMachine.success(sg, def, 1, fwd, nil, 0, "")
		require.Nil(t, d.tr.LastError)
		require.Nil(t, d.tr.LastErrorCode)
		require.Nil(t, d.tr.FailedStep)
		require.Empty(t, d.tr.InboxKey)
	})

	t.Run("a deduplicated step moves on, saying so first", func(t *testing.T) {
		t.Parallel()
		d := testMachine.deduplicated(at(def, "reserve", fwd, store.StatusRunning, 0), def, 0, fwd)
		require.Equal(t, outcome{Status: store.StatusRunning, Step: "charge", Dir: fwd, CheckAfter: 20*time.Second + testSlack,
			Next: next("charge", fwd, 2, 0), Events: []string{EventStepDeduplicated, EventStepCompleted}}, summary(d))
		require.Nil(t, d.tr.State, "a deduplicated step keeps the stored state")
		require.Empty(t, d.tr.InboxKey)
	})
}

func TestMachineFailure(t *testing.T) {
	t.Parallel()
	def := testDef(t)
	plain := errors.New("boom")
	for _, tc := range []struct {
		name    string
		sg      *store.Saga
		attempt int
		err     error
		want    outcome
	}{
		{"retry: the same step after its backoff", at(def, "charge", fwd, store.StatusRunning, 0), 1, plain, outcome{
			Status: store.StatusRunning, Step: "charge", Dir: fwd, Attempt: 1,
			CheckAfter: time.Second + 20*time.Second + testSlack, Next: next("charge", fwd, 2, time.Second), Retry: true,
			Events: []string{EventStepFailed}, Code: CodeError}},
		{"retry: the backoff grows with the attempt", at(def, "charge", fwd, store.StatusRunning, 1), 2, plain, outcome{
			Status: store.StatusRunning, Step: "charge", Dir: fwd, Attempt: 2,
			CheckAfter: 2*time.Second + 20*time.Second + testSlack, Next: next("charge", fwd, 2, 2*time.Second), Retry: true,
			Events: []string{EventStepFailed}, Code: CodeError}},
		{"retry: RetryAfter sets the delay", at(def, "charge", fwd, store.StatusRunning, 0), 1, steps.RetryAfter(time.Hour, plain), outcome{
			Status: store.StatusRunning, Step: "charge", Dir: fwd, Attempt: 1,
			CheckAfter: time.Hour + 20*time.Second + testSlack, Next: next("charge", fwd, 2, time.Hour), Retry: true,
			Events: []string{EventStepFailed}, Code: CodeError}},
		{"a timeout is retried like any failure, with its code", at(def, "charge", fwd, store.StatusRunning, 0), 1,
			steps.WithCode(CodeTimeout, plain), outcome{
				Status: store.StatusRunning, Step: "charge", Dir: fwd, Attempt: 1,
				CheckAfter: time.Second + 20*time.Second + testSlack, Next: next("charge", fwd, 2, time.Second), Retry: true,
				Events: []string{EventStepFailed}, Code: CodeTimeout}},
		{"a timeout on the last attempt compensates", at(def, "charge", fwd, store.StatusRunning, 2), 3,
			steps.WithCode(CodeTimeout, plain), outcome{
				Status: store.StatusCompensating, Step: "reserve", Dir: comp, CheckAfter: 10*time.Second + testSlack,
				Next: next("reserve", comp, 2, 0), Events: []string{EventStepFailed, EventCompensationStarted},
				Code: CodeTimeout, FailedStep: "charge"}},
		{"permanent: compensation from the step before", at(def, "charge", fwd, store.StatusRunning, 0), 1,
			steps.Permanent(steps.WithCode("card_declined", plain)), outcome{
				Status: store.StatusCompensating, Step: "reserve", Dir: comp, CheckAfter: 10*time.Second + testSlack,
				Next: next("reserve", comp, 2, 0), Events: []string{EventStepFailed, EventCompensationStarted},
				Code: "card_declined", FailedStep: "charge"}},
		{"exhausted: compensation from the step before", at(def, "charge", fwd, store.StatusRunning, 2), 3, plain, outcome{
			Status: store.StatusCompensating, Step: "reserve", Dir: comp, CheckAfter: 10*time.Second + testSlack,
			Next: next("reserve", comp, 2, 0), Events: []string{EventStepFailed, EventCompensationStarted},
			Code: CodeError, FailedStep: "charge"}},
		{"exhausted: steps without a compensation are skipped", at(def, "ship", fwd, store.StatusRunning, 2), 3, plain, outcome{
			Status: store.StatusCompensating, Step: "charge", Dir: comp, CheckAfter: 20*time.Second + testSlack,
			Next: next("charge", comp, 2, 0), Events: []string{EventStepFailed, EventCompensationStarted},
			Code: CodeError, FailedStep: "ship"}},
		{"the first step fails for good: nothing to compensate", at(def, "reserve", fwd, store.StatusRunning, 0), 1,
			steps.Permanent(plain), outcome{
				Status: store.StatusCompensated, Step: "reserve", Dir: fwd, Attempt: 1,
				Events: []string{EventStepFailed, EventSagaCompensated}, Code: CodeError, FailedStep: "reserve"}},
		{"state that does not decode fails the saga at once", at(def, "charge", fwd, store.StatusRunning, 0), 1,
			&stateDecodeError{err: plain}, outcome{
				Status: store.StatusFailed, Step: "charge", Dir: fwd, Attempt: 1,
				Events: []string{EventStepFailed, EventSagaFailed}, Code: CodeStateDecode, FailedStep: "charge"}},
		{"a panic is retried, coded panic", at(def, "charge", fwd, store.StatusRunning, 0), 1,
			&panicError{value: "oops", stack: []byte("stack")}, outcome{
				Status: store.StatusRunning, Step: "charge", Dir: fwd, Attempt: 1,
				CheckAfter: time.Second + 20*time.Second + testSlack, Next: next("charge", fwd, 2, time.Second), Retry: true,
				Events: []string{EventStepFailed}, Code: CodePanic}},
		{"a compensation is retried after its own backoff", at(def, "charge", comp, store.StatusCompensating, 0), 1, plain, outcome{
			Status: store.StatusCompensating, Step: "charge", Dir: comp, Attempt: 1,
			CheckAfter: time.Minute + 20*time.Second + testSlack, Next: next("charge", comp, 2, time.Minute), Retry: true,
			Events: []string{EventStepFailed}}},
		{"a compensation out of attempts fails the saga", at(def, "charge", comp, store.StatusCompensating, 1), 2, plain, outcome{
			Status: store.StatusFailed, Step: "charge", Dir: comp, Attempt: 2,
			Events: []string{EventStepFailed, EventSagaFailed}, Code: CodeError, FailedStep: "charge"}},
		{"a compensation that fails for good fails the saga", at(def, "charge", comp, store.StatusCompensating, 0), 1,
			steps.Permanent(plain), outcome{
				Status: store.StatusFailed, Step: "charge", Dir: comp, Attempt: 1,
				Events: []string{EventStepFailed, EventSagaFailed}, Code: CodeError, FailedStep: "charge"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			idx := def.byName[tc.sg.StepName]
			d := testMachine.failure(tc.sg, def, idx, steps.Direction(tc.sg.Direction), tc.attempt, tc.err, time.Millisecond)
			require.Equal(t, tc.want, summary(d))
			failed := d.tr.History[0]
			var pe *panicError
			var de *stateDecodeError
			switch {
			case errors.As(tc.err, &pe):
				require.Equal(t, "panic: oops", failed.Error)
			case errors.As(tc.err, &de):
				require.Equal(t, "decode state: boom", failed.Error)
			default:
				require.Equal(t, "boom", failed.Error, "the stored message is the handler's, without the outcome wrappers")
			}
			require.Equal(t, tc.attempt, failed.Attempt)
			var detail map[string]any
			require.NoError(t, json.Unmarshal(failed.Detail, &detail))
			if tc.want.Retry {
				require.EqualValues(t, tc.want.Next.delay.Milliseconds(), detail["retry_in_ms"])
				require.Nil(t, detail["final"])
			} else {
				require.Equal(t, true, detail["final"])
			}
		})
	}

	t.Run("a panic's stack is kept", func(t *testing.T) {
		t.Parallel()
		d := testMachine.failure(at(def, "charge", fwd, store.StatusRunning, 0), def, 1, fwd, 1,
			&panicError{value: "oops", stack: []byte("the stack")}, 0)
		require.Contains(t, string(d.tr.History[0].Detail), "the stack")
		require.Equal(t, "panic: oops", d.tr.History[0].Error)
	})

	t.Run("a code PostgreSQL cannot store is made storable", func(t *testing.T) {
		t.Parallel()
		d := testMachine.failure(at(def, "charge", fwd, store.StatusRunning, 0), def, 1, fwd, 1,
			steps.WithCode("bad\x00code", plain), 0)
		require.NotContains(t, *d.tr.LastErrorCode, "\x00")
	})
}

func TestMachineRemote(t *testing.T) {
	t.Parallel()
	def := remoteDef(t)
	pay := def.byName["pay"]
	awaiting := func(dir steps.Direction, status string) *store.Saga {
		sg := at(def, "pay", dir, status, 0)
		sg.AwaitingReply = true
		return sg
	}

	t.Run("sent: the saga waits for the reply until exactly the timeout", func(t *testing.T) {
		t.Parallel()
		msg := store.Message{ID: uuid.New(), Topic: "payments", Type: "pay"}
		d := testMachine.sent(at(def, "pay", fwd, store.StatusRunning, 0), def, pay, fwd, msg)
		require.Equal(t, outcome{Status: store.StatusRunning, Step: "pay", Dir: fwd, CheckAfter: 20 * time.Second,
			Events: []string{EventCommandSent}, Awaiting: true}, summary(d))
		require.True(t, d.tr.ExactDeadline)
		require.Equal(t, []store.Message{msg}, d.tr.Messages)
	})
	t.Run("a successful reply completes the step", func(t *testing.T) {
		t.Parallel()
		d := testMachine.replied(awaiting(fwd, store.StatusRunning), def, pay, fwd, []byte(`{}`), "key")
		require.Equal(t, outcome{Status: store.StatusRunning, Step: "ship", Dir: fwd, CheckAfter: 30*time.Second + testSlack,
			Next: next("ship", fwd, 2, 0), Events: []string{EventReplyReceived, EventStepCompleted}}, summary(d))
		require.Equal(t, "key", d.tr.InboxKey)
	})
	t.Run("a refusal compensates the steps before, not the refused one", func(t *testing.T) {
		t.Parallel()
		sg := awaiting(fwd, store.StatusRunning)
		d := testMachine.refused(sg, def, pay, fwd, steps.Reply{Error: "no funds"})
		require.Equal(t, outcome{Status: store.StatusCompensating, Step: "reserve", Dir: comp,
			CheckAfter: 10*time.Second + testSlack, Next: next("reserve", comp, 2, 0),
			Events: []string{EventStepFailed, EventCompensationStarted}, Code: CodeRefused, FailedStep: "pay"}, summary(d))
		require.Equal(t, "no funds", d.tr.History[0].Error)
		require.True(t, sg.AwaitingReply, "the decision does not change the saga it was given")
	})
	t.Run("a refusal keeps the participant's code", func(t *testing.T) {
		t.Parallel()
		d := testMachine.refused(awaiting(fwd, store.StatusRunning), def, pay, fwd, steps.Reply{Error: "no funds", Code: "insufficient_funds"})
		require.Equal(t, "insufficient_funds", *d.tr.LastErrorCode)
	})
	t.Run("a forward step that fails for good while its reply is awaited is compensated itself", func(t *testing.T) {
		t.Parallel()
		d := testMachine.failure(awaiting(fwd, store.StatusRunning), def, pay, fwd, 1, steps.Permanent(errors.New("late")), 0)
		require.Equal(t, "pay", d.tr.StepName)
		require.Equal(t, next("pay", comp, 2, 0), d.next)
		require.False(t, d.tr.AwaitingReply, "the compensation does not wait for the reply")
	})
}

func TestMachineCancel(t *testing.T) {
	t.Parallel()
	def := testDef(t)
	for _, tc := range []struct {
		name string
		sg   *store.Saga
		want outcome
	}{
		{"the steps before compensate", at(def, "notify", fwd, store.StatusRunning, 1), outcome{
			Status: store.StatusCompensating, Step: "charge", Dir: comp, CheckAfter: 20*time.Second + testSlack,
			Next: next("charge", comp, 2, 0), Events: []string{EventSagaCancelled, EventCompensationStarted},
			Code: CodeCancelled, ClearCancel: true}},
		{"at the first step: compensated at once", at(def, "reserve", fwd, store.StatusRunning, 0), outcome{
			Status: store.StatusCompensated, Step: "reserve", Dir: fwd,
			Events: []string{EventSagaCancelled, EventSagaCompensated}, Code: CodeCancelled, ClearCancel: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			d := testMachine.cancel(tc.sg, def, def.byName[tc.sg.StepName], "customer asked", "")
			require.Equal(t, tc.want, summary(d))
			require.Equal(t, "customer asked", *d.tr.LastError)
			require.Nil(t, d.tr.FailedStep)
		})
	}

	t.Run("a remote step whose command went out is compensated too", func(t *testing.T) {
		t.Parallel()
		rdef := remoteDef(t)
		sg := at(rdef, "pay", fwd, store.StatusRunning, 0)
		sg.AwaitingReply = true
		d := testMachine.cancel(sg, rdef, 1, "stop", "")
		require.Equal(t, next("pay", comp, 2, 0), d.next)
		require.False(t, d.tr.AwaitingReply)
	})

	for _, tc := range []struct {
		name   string
		status string
		epoch  int
		want   string
	}{
		{"running, same run: applies", store.StatusRunning, 2, ""},
		{"ended", store.StatusCompleted, 2, "the saga had ended: completed"},
		{"failed", store.StatusFailed, 2, "the saga had ended: failed"},
		{"compensating", store.StatusCompensating, 2, "the saga was compensating already"},
		{"another run", store.StatusRunning, 1, "requested for run 1; the saga is in run 2"},
	} {
		t.Run("refusal: "+tc.name, func(t *testing.T) {
			t.Parallel()
			sg := at(def, "charge", fwd, tc.status, 0)
			require.Equal(t, tc.want, cancelRefusal(sg, &store.CancelRequest{Epoch: tc.epoch, Reason: "r"}))
		})
	}

	for _, tc := range []struct {
		name   string
		err    error
		dir    steps.Direction
		status string
		want   bool
	}{
		{"a request for this run interrupts a forward step", &cancelRequested{reason: "r", epoch: 2}, fwd, store.StatusRunning, true},
		{"wrapped too", fmt.Errorf("step: %w", &cancelRequested{reason: "r", epoch: 2}), fwd, store.StatusRunning, true},
		{"not a compensation", &cancelRequested{reason: "r", epoch: 2}, comp, store.StatusCompensating, false},
		{"not a request for another run", &cancelRequested{reason: "r", epoch: 1}, fwd, store.StatusRunning, false},
		{"not another error", errors.New("boom"), fwd, store.StatusRunning, false},
		{"not success", nil, fwd, store.StatusRunning, false},
	} {
		t.Run("interrupt: "+tc.name, func(t *testing.T) {
			t.Parallel()
			reason, _, ok := interruptedBy(tc.err, at(def, "charge", tc.dir, tc.status, 0), tc.dir)
			require.Equal(t, tc.want, ok)
			if ok {
				require.Equal(t, "r", reason)
			}
		})
	}
}

func TestMachineRescue(t *testing.T) {
	t.Parallel()
	def := testDef(t)
	rdef := remoteDef(t)
	cmdID := uuid.New()
	stuck := func(def *compiled, step string, dir steps.Direction, status string, attempts int, cmdStatus string) *store.StuckSaga {
		return &store.StuckSaga{Saga: *at(def, step, dir, status, attempts), Locked: true, CommandStatus: cmdStatus, Overdue: 90 * time.Second}
	}
	awaiting := func(dir steps.Direction, status string, attempts int) *store.StuckSaga {
		s := stuck(rdef, "pay", dir, status, attempts, store.OutboxPending)
		s.AwaitingReply, s.CommandID = true, &cmdID
		return s
	}
	busy := stuck(def, "charge", fwd, store.StatusRunning, 0, "")
	busy.Locked = false
	for _, tc := range []struct {
		name      string
		s         *store.StuckSaga
		def       *compiled
		action    rescueAction
		supersede bool
		want      outcome // zero for busy and waiting
	}{
		{"a step runs: busy", busy, def, rescueBusy, false, outcome{}},
		{"its command waits in the queue", stuck(def, "charge", fwd, store.StatusRunning, 0, store.OutboxPending), def, rescueWaiting, false, outcome{}},
		{"its command was published lately", stuck(def, "charge", fwd, store.StatusRunning, 0, "in_flight"), def, rescueWaiting, false, outcome{}},
		{"its command was lost: re-driven, the attempt counted", stuck(def, "charge", fwd, store.StatusRunning, 0, ""), def, rescueRedrive, false, outcome{
			Status: store.StatusRunning, Step: "charge", Dir: fwd, Attempt: 1, CheckAfter: 20*time.Second + testSlack,
			Next: next("charge", fwd, 2, 0), Events: []string{EventSagaRescued}}},
		{"its command is dead: re-driven", stuck(def, "charge", comp, store.StatusCompensating, 0, "dead"), def, rescueRedrive, false, outcome{
			Status: store.StatusCompensating, Step: "charge", Dir: comp, Attempt: 1, CheckAfter: 20*time.Second + testSlack,
			Next: next("charge", comp, 2, 0), Events: []string{EventSagaRescued}}},
		{"lost on its last attempt: fails over to compensation", stuck(def, "charge", fwd, store.StatusRunning, 2, ""), def, rescueFailOver, false, outcome{
			Status: store.StatusCompensating, Step: "reserve", Dir: comp, CheckAfter: 10*time.Second + testSlack,
			Next: next("reserve", comp, 2, 0), Events: []string{EventSagaRescued, EventStepFailed, EventCompensationStarted},
			Code: CodeRescueExhausted, FailedStep: "charge"}},
		{"a compensation lost on its last attempt: the saga fails", stuck(def, "charge", comp, store.StatusCompensating, 1, ""), def, rescueFailOver, false, outcome{
			Status: store.StatusFailed, Step: "charge", Dir: comp, Attempt: 2,
			Events: []string{EventSagaRescued, EventStepFailed, EventSagaFailed}, Code: CodeRescueExhausted, FailedStep: "charge"}},
		{"no reply in time: the step fails for good and is compensated itself", awaiting(fwd, store.StatusRunning, 0), rdef, rescueFailOver, true, outcome{
			Status: store.StatusCompensating, Step: "pay", Dir: comp, CheckAfter: 20*time.Second + testSlack,
			Next: next("pay", comp, 2, 0), Events: []string{EventStepFailed, EventCompensationStarted},
			Code: CodeReplyTimeout, FailedStep: "pay"}},
		{"no reply to a compensation in time: sent again", awaiting(comp, store.StatusCompensating, 0), rdef, rescueRedrive, true, outcome{
			Status: store.StatusCompensating, Step: "pay", Dir: comp, Attempt: 1, CheckAfter: time.Second + 20*time.Second + testSlack,
			Next: next("pay", comp, 2, time.Second), Retry: true, Events: []string{EventStepFailed}}},
		{"a step only another engine knows: re-driven, no attempt counted", stuck(def, "gone", fwd, store.StatusRunning, 1, ""), def, rescueRedrive, false, outcome{
			Status: store.StatusRunning, Step: "gone", Dir: fwd, Attempt: 1, CheckAfter: StepTimeoutDefault + testSlack,
			Next: next("gone", fwd, 2, 0), Events: []string{EventSagaRescued}}},
		{"a saga this engine does not know: re-driven", stuck(def, "charge", fwd, store.StatusRunning, 0, ""), nil, rescueRedrive, false, outcome{
			Status: store.StatusRunning, Step: "charge", Dir: fwd, CheckAfter: StepTimeoutDefault + testSlack,
			Next: next("charge", fwd, 2, 0), Events: []string{EventSagaRescued}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got := testMachine.rescue(tc.s, tc.def)
			require.Equal(t, tc.action, got.action)
			require.Equal(t, tc.supersede, got.supersede)
			if tc.action == rescueBusy || tc.action == rescueWaiting {
				require.Nil(t, got.d.tr, "only the deadline moves")
				return
			}
			require.Equal(t, tc.want, summary(got.d))
			require.Equal(t, tc.s.Version, got.d.tr.Version)
		})
	}

	t.Run("the rescue says why", func(t *testing.T) {
		t.Parallel()
		got := testMachine.rescue(stuck(def, "charge", fwd, store.StatusRunning, 0, "published"), def)
		require.Contains(t, string(got.d.tr.History[0].Detail), "no progress 1m30s past the deadline; the step's command is published")
	})
}

func TestMachineResume(t *testing.T) {
	t.Parallel()
	def := testDef(t)
	failedAt := func(step string, dir steps.Direction) *store.Saga {
		sg := at(def, step, dir, store.StatusFailed, 3)
		msg, code := "boom", CodeError
		sg.LastError, sg.LastErrorCode, sg.FailedStep = &msg, &code, &step
		return sg
	}
	str := func(s string) *string { return &s }
	epoch := 2
	cause := store.History{Event: EventStepFailed, StepName: str("ship"), Direction: str(string(fwd)), Epoch: &epoch,
		Error: str("no truck"), ErrorCode: str("no_truck")}

	t.Run("failed forward: the step runs again, attempts afresh", func(t *testing.T) {
		t.Parallel()
		d, err := testMachine.resume(failedAt("charge", fwd), def, nil, "fixed")
		require.NoError(t, err)
		require.Equal(t, outcome{Status: store.StatusRunning, Step: "charge", Dir: fwd, CheckAfter: 20*time.Second + testSlack,
			Next: next("charge", fwd, 2, 0), Events: []string{EventSagaResumed}, Code: CodeError, FailedStep: "charge"}, summary(d))
		require.Equal(t, "boom", d.tr.History[0].Error, "the failure resumed past stays visible")
	})
	t.Run("failed compensating: the compensation runs again, its cause restored", func(t *testing.T) {
		t.Parallel()
		d, err := testMachine.resume(failedAt("charge", comp), def, []store.History{cause}, "fixed")
		require.NoError(t, err)
		require.Equal(t, outcome{Status: store.StatusCompensating, Step: "charge", Dir: comp, CheckAfter: 20*time.Second + testSlack,
			Next: next("charge", comp, 2, 0), Events: []string{EventSagaResumed}, Code: "no_truck", FailedStep: "ship"}, summary(d))
	})
	t.Run("without the definition: the default timeout", func(t *testing.T) {
		t.Parallel()
		d, err := testMachine.resume(failedAt("charge", fwd), nil, nil, "")
		require.NoError(t, err)
		require.Equal(t, StepTimeoutDefault+testSlack, d.tr.CheckAfter)
	})
	for _, status := range []string{store.StatusRunning, store.StatusCompensating, store.StatusCompleted, store.StatusCompensated} {
		t.Run("refused: "+status, func(t *testing.T) {
			t.Parallel()
			_, err := testMachine.resume(at(def, "charge", fwd, status, 0), def, nil, "")
			require.ErrorIs(t, err, ErrNotReplayable)
		})
	}
	t.Run("refused: a direction that is not one", func(t *testing.T) {
		t.Parallel()
		_, err := testMachine.resume(failedAt("charge", "sideways"), def, nil, "")
		require.ErrorContains(t, err, `direction "sideways" is not valid`)
	})
}

func TestMachineRerun(t *testing.T) {
	t.Parallel()
	def := testDef(t)
	ok := func(from string) outcome {
		return outcome{Status: store.StatusRunning, Step: from, Dir: fwd, CheckAfter: def.steps[def.byName[from]].timeout + testSlack,
			Next: next(from, fwd, 3, 0), Events: []string{EventSagaRerun}}
	}
	for _, tc := range []struct {
		name    string
		sg      *store.Saga
		def     *compiled
		from    string
		want    outcome
		wantErr string // "" for none
	}{
		{"completed: from any step, under a new epoch", at(def, "ship", fwd, store.StatusCompleted, 1), def, "notify", ok("notify"), ""},
		{"compensated: from the first step", at(def, "reserve", comp, store.StatusCompensated, 1), def, "reserve", ok("reserve"), ""},
		{"compensated: not from a later step", at(def, "reserve", comp, store.StatusCompensated, 1), def, "charge", outcome{},
			`it can only re-run from its first step "reserve", not "charge"`},
		{"failed forward: from any step", at(def, "ship", fwd, store.StatusFailed, 3), def, "charge", ok("charge"), ""},
		{"failed compensating: from a step after the one that failed", at(def, "charge", comp, store.StatusFailed, 2), def, "notify", ok("notify"), ""},
		{"failed compensating: not from that step", at(def, "charge", comp, store.StatusFailed, 2), def, "charge", outcome{},
			`whose effects (and those of the steps before it) are still in effect`},
		{"failed compensating: only an engine that knows the saga", at(def, "charge", comp, store.StatusFailed, 2), nil, "notify", outcome{},
			`only an engine that knows saga "order"`},
		{"running: refused", at(def, "charge", fwd, store.StatusRunning, 0), def, "reserve", outcome{}, "only ended sagas re-run"},
		{"compensating: refused", at(def, "charge", comp, store.StatusCompensating, 0), def, "reserve", outcome{}, "only ended sagas re-run"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			msg, code := "boom", CodeError
			tc.sg.LastError, tc.sg.LastErrorCode = &msg, &code
			d, err := testMachine.rerun(tc.sg, tc.def, def.byName[tc.from], "reserve", tc.from, "again")
			if tc.wantErr != "" {
				require.ErrorIs(t, err, ErrNotReplayable)
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, summary(d))
			require.Equal(t, def.byName[tc.from], d.tr.StepIndex)
			require.Equal(t, 3, d.tr.Epoch)
			require.Nil(t, d.tr.LastError, "a new run starts without the old error")
		})
	}
	t.Run("without the definition, the default timeout", func(t *testing.T) {
		t.Parallel()
		d, err := testMachine.rerun(at(def, "ship", fwd, store.StatusCompleted, 1), nil, -1, "reserve", "notify", "")
		require.NoError(t, err)
		require.Equal(t, StepTimeoutDefault+testSlack, d.tr.CheckAfter)
		require.Equal(t, -1, d.tr.StepIndex)
	})
}

func TestMachineParks(t *testing.T) {
	t.Parallel()
	def := testDef(t)

	t.Run("state too large", func(t *testing.T) {
		t.Parallel()
		err := testMachine.checkState("charge", make([]byte, 65))
		require.True(t, steps.IsPermanent(err))
		require.Equal(t, CodeTooLarge, steps.Code(err))
		require.NoError(t, testMachine.checkState("charge", make([]byte, 64)))
	})
	t.Run("state with a NUL", func(t *testing.T) {
		t.Parallel()
		err := testMachine.checkState("charge", []byte(`{"a":"\u0000"}`))
		require.True(t, steps.IsPermanent(err))
		require.Equal(t, CodeStateEncode, steps.Code(err))
	})
	t.Run("an outcome PostgreSQL refused", func(t *testing.T) {
		t.Parallel()
		d := invalidOutcome(at(def, "charge", fwd, store.StatusRunning, 0), errors.New("bad \x00 byte"))
		require.Equal(t, outcome{Status: store.StatusFailed, Step: "charge", Dir: fwd, Events: []string{EventSagaFailed},
			Code: CodeInvalidOutcome, FailedStep: "charge"}, summary(d))
		require.NotContains(t, *d.tr.LastError, "\x00")
	})
	t.Run("a step no engine knew", func(t *testing.T) {
		t.Parallel()
		d := unknownStep(at(def, "gone", fwd, store.StatusRunning, 0), "no step gone")
		require.Equal(t, outcome{Status: store.StatusFailed, Step: "gone", Dir: fwd, Events: []string{EventSagaFailed},
			Code: CodeUnknownStep, FailedStep: "gone"}, summary(d))
		require.Equal(t, "no step gone", *d.tr.LastError)
	})
}

// TestMachineStoresTheTextOfANULEscape: the six characters \u0000 in a
// string are text jsonb stores; only a NUL character is refused.
func TestMachineStoresTheTextOfANULEscape(t *testing.T) {
	t.Parallel()
	raw, err := json.Marshal(map[string]string{"path": `C:\u0000dir`})
	require.NoError(t, err)
	require.NoError(t, testMachine.checkState("charge", raw))
	raw, err = json.Marshal(map[string]string{"path": "C:\x00dir"})
	require.NoError(t, err)
	require.Equal(t, CodeStateEncode, steps.Code(testMachine.checkState("charge", raw)))
}

// Every rescue deadline a decision writes is the sum of what the saga does
// next and the slack, and no sum wraps: a wait of the longest duration (a
// SleepUntil in the year 9999) stays the longest, not a time in the past.
// The PostgreSQL settings in milliseconds stop at their largest value.
func TestDeadlineSumsStopAtTheLongestDuration(t *testing.T) {
	const longest = time.Duration(math.MaxInt64)
	cases := []struct {
		name string
		ds   []time.Duration
		want time.Duration
	}{
		{"nothing: the slack", nil, testSlack},
		{"a timeout and the slack", []time.Duration{time.Minute}, time.Minute + testSlack},
		{"a delay, a timeout and the slack", []time.Duration{time.Second, time.Minute}, time.Second + time.Minute + testSlack},
		{"the longest wait", []time.Duration{longest, time.Minute}, longest},
		{"a wait just short of the longest", []time.Duration{longest - testSlack, time.Nanosecond}, longest},
		{"two halves of the longest", []time.Duration{longest / 2, longest / 2}, longest},
		{"a negative duration adds nothing past the cap", []time.Duration{longest, -time.Hour}, longest},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			require.Equal(t, c.want, testMachine.deadline(c.ds...))
		})
	}
	require.Equal(t, "60000", settingMillis(time.Minute))
	require.Equal(t, "2147483647", settingMillis(30*24*time.Hour), "30 days is past the setting's largest value")
	require.Equal(t, "2147483647", settingMillis(longest, 5*time.Second), "the longest step timeout must not wrap negative")
}

// A negative retry delay, from a BackoffFunc or a RetryAfterError built by
// hand, is no delay: the retry is due now and the rescue deadline is the
// step's timeout and the slack from now. Taken as it was, an hour's negative
// delay put the deadline an hour back, in the past, and the rescuer would
// take a saga whose retry was on its way for stuck.
func TestANegativeRetryDelayIsNone(t *testing.T) {
	t.Parallel()
	for name, d := range map[string]time.Duration{"an hour back": -time.Hour, "the shortest duration": math.MinInt64} {
		for how, herr := range map[string]error{
			"backoff":     errors.New("down"),
			"retry after": &steps.RetryAfterError{Delay: d, Err: errors.New("later")},
		} {
			t.Run(name+", "+how, func(t *testing.T) {
				t.Parallel()
				def, err := Define("neg", Step[noState]{Name: "flaky", Action: noop, Timeout: 10 * time.Second,
					Retry: &RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return d }}}).compile()
				require.NoError(t, err)
				dec := testMachine.failure(at(def, "flaky", steps.Forward, store.StatusRunning, 0), def, 0, steps.Forward, 1, herr, 0)
				require.True(t, dec.retry)
				require.NotNil(t, dec.next)
				require.Equal(t, time.Duration(0), dec.next.delay)
				require.Equal(t, 10*time.Second+testSlack, dec.tr.CheckAfter)
			})
		}
	}
}
