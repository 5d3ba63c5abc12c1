package review6_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// doc.go "Pause": "a step that runs when the pause commits finishes and
// records its outcome, and the command it writes next waits." and
// "A paused saga starts no new step". Also: "[Instance.Paused] shows it,
// [ListOpts.Paused] finds paused sagas", and Resume: "it continues where it
// paused".
func TestPauseWhileStepRuns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	g := newGate()
	d := saga.Define("p-run",
		saga.Step[st]{Name: "a", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
			if err := v.fx.Record(ctx, run, "a"); err != nil {
				return err
			}
			return g.wait(ctx)
		}},
		saga.Step[st]{Name: "b", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
			return v.fx.Record(ctx, run, "b")
		}})
	e := v.engine(t, true, d)
	s, err := saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	g.waitEntered(t)
	require.NoError(t, e.Pause(ctx, s.ID, "incident 42"))
	close(g.release)

	// a finishes and records its outcome.
	in := sagatest.Wait(t, e, s.ID, sagatest.Event("step_completed:a"), nil)
	require.Equal(t, 1, v.fx.Count(t, s.ID, "a"))
	require.NotNil(t, in.Paused, "Instance.Paused shows the pause")
	require.Equal(t, saga.PauseCodeOperator, in.Paused.Code)
	require.Equal(t, "incident 42", in.Paused.Reason)
	require.False(t, in.Paused.Type)

	list, err := e.List(ctx, &saga.ListOpts{Paused: true})
	require.NoError(t, err)
	require.Len(t, list.Sagas, 1)
	require.Equal(t, s.ID, list.Sagas[0].ID)

	// b does not start while paused.
	testkit.Hold(t, 1500*time.Millisecond, "step b does not run while paused", func() bool {
		return v.fx.Count(t, s.ID, "b") == 0
	})
	require.Equal(t, saga.StatusRunning, get(t, e, s.ID).Status)

	require.NoError(t, e.Resume(ctx, s.ID, "incident over"))
	in = testkit.WaitEnded(t, e, s.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Nil(t, in.Paused)
	require.Equal(t, map[string]int{"a": 1, "b": 1}, v.fx.Counts(t, s.ID))
	require.Equal(t, 1, events(in, saga.EventSagaPaused))
	require.Equal(t, 1, events(in, saga.EventSagaUnpaused))
	list, err = e.List(ctx, &saga.ListOpts{Paused: true})
	require.NoError(t, err)
	require.Empty(t, list.Sagas, "an ended saga is not listed as paused")
}

// Engine.Pause: "A cancel request is recorded; its compensations wait
// too." doc.go: "a cancel of a paused saga is recorded and compensates
// after the resume".
func TestPauseThenCancel(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	g := newGate()
	d := saga.Define("p-cancel",
		saga.Step[st]{Name: "a",
			Action: func(ctx context.Context, run *saga.StepRun, _ *st) error { return v.fx.Record(ctx, run, "a") },
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *st) error {
				return v.fx.Record(ctx, run, "undo-a")
			}},
		saga.Step[st]{Name: "b", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
			if err := v.fx.Record(ctx, run, "b"); err != nil {
				return err
			}
			return g.wait(ctx)
		}, Compensate: func(ctx context.Context, run *saga.StepRun, _ *st) error {
			return v.fx.Record(ctx, run, "undo-b")
		}},
		saga.Step[st]{Name: "c", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
			return v.fx.Record(ctx, run, "c")
		}})
	e := v.engine(t, true, d)
	s, err := saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	g.waitEntered(t)
	require.NoError(t, e.Pause(ctx, s.ID, "hold"))
	close(g.release)
	sagatest.Wait(t, e, s.ID, sagatest.Event("step_completed:b"), nil)

	require.NoError(t, e.Cancel(ctx, s.ID, "customer left"))
	testkit.Hold(t, time.Second, "no compensation runs while paused", func() bool {
		c := v.fx.Counts(t, s.ID)
		return c["undo-a"] == 0 && c["undo-b"] == 0 && c["c"] == 0
	})
	in := get(t, e, s.ID)
	require.False(t, in.Status.Terminal(), "a paused, cancelled saga has not ended: %s", in.Status)
	require.NotNil(t, in.Paused)

	require.NoError(t, e.Resume(ctx, s.ID, "go"))
	in = testkit.WaitEnded(t, e, s.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, map[string]int{"a": 1, "b": 1, "undo-b": 1, "undo-a": 1}, v.fx.Counts(t, s.ID))
}

// doc.go "Pause": "a timer that fell due during the pause fires once, after
// it"; "A paused saga starts no new step, compensation, retry, timer".
func TestPauseSleepingTimer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	d := saga.Define("p-timer",
		saga.Step[st]{Name: "nap", Wait: saga.Sleep[st](700 * time.Millisecond)},
		saga.Step[st]{Name: "after", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
			return v.fx.Record(ctx, run, "after")
		}})
	e := v.engine(t, true, d)
	s, err := saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	sagatest.Wait(t, e, s.ID, sagatest.Cond("wait on its timer", func(in *saga.Instance) bool {
		return in.Wait != nil && in.Wait.Kind == "timer"
	}), nil)
	require.NoError(t, e.Pause(ctx, s.ID, "hold the timer"))
	// The timer falls due during the pause, and must not fire.
	testkit.Hold(t, 2*time.Second, "the timer does not fire while paused", func() bool {
		in := get(t, e, s.ID)
		return events(in, "timer_fired:nap") == 0 && v.fx.Count(t, s.ID, "after") == 0
	})
	require.NoError(t, e.Resume(ctx, s.ID, ""))
	in := testkit.WaitEnded(t, e, s.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, 1, events(in, "timer_fired:nap"), sagatest.Describe(in))
	require.Equal(t, 1, v.fx.Count(t, s.ID, "after"))
}

// Pausing and resuming many times quickly loses and doubles nothing:
// "Resume ... lifts the pause: each held command becomes due when it was
// due before" and guarantee 3, "the rows a handler writes through run.Tx
// exist exactly once". Pause: "Pausing a paused saga does nothing."
func TestPauseResumeFlapping(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	var ss []saga.Step[st]
	for i := range 6 {
		name := fmt.Sprintf("s%d", i)
		ss = append(ss, saga.Step[st]{Name: name, Action: func(ctx context.Context, run *saga.StepRun, s *st) error {
			s.N++
			return v.fx.Record(ctx, run, name)
		}})
	}
	d := saga.Define("p-flap", ss...)
	e := v.engine(t, true, d)
	var ids []uuid.UUID
	for range 20 {
		s, err := saga.Start(ctx, e, d, st{}, nil)
		require.NoError(t, err)
		ids = append(ids, s.ID)
	}
	var wg sync.WaitGroup
	for _, id := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 15 {
				err := e.Pause(ctx, id, "flap")
				if errors.Is(err, saga.ErrNotRunning) {
					return
				}
				if err != nil {
					t.Errorf("pause %s: %v", id, err)
					return
				}
				_ = e.Pause(ctx, id, "flap again") // pausing a paused saga does nothing
				if err := e.Resume(ctx, id, "flap"); err != nil && !errors.Is(err, saga.ErrNotReplayable) {
					t.Errorf("resume %s: %v", id, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	for _, id := range ids {
		// A saga may be left paused by the last Pause only if Resume then
		// failed; lift any pause left.
		if in := get(t, e, id); in.Paused != nil {
			require.NoError(t, e.Resume(ctx, id, "final"))
		}
	}
	for _, id := range ids {
		in := testkit.WaitEnded(t, e, id)
		require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
		var s st
		require.NoError(t, in.DecodeState(&s))
		require.Equal(t, 6, s.N)
		c := v.fx.Counts(t, id)
		for i := range 6 {
			require.Equal(t, 1, c[fmt.Sprintf("s%d", i)], "saga %s effects %v", id, c)
		}
		require.Nil(t, in.Paused)
	}
}

// Engine.Pause: "It returns an error wrapping ErrNotFound for an unknown id
// and ErrNotRunning for a saga that has ended."
func TestPauseEndedOrUnknownSaga(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	d := saga.Define("p-ended", saga.Step[st]{Name: "a", Action: noop})
	e := v.engine(t, true, d)
	s, err := saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	testkit.WaitEnded(t, e, s.ID)
	err = e.Pause(ctx, s.ID, "late")
	require.ErrorIs(t, err, saga.ErrNotRunning)
	err = e.Pause(ctx, uuid.New(), "nobody")
	require.ErrorIs(t, err, saga.ErrNotFound)
	in := get(t, e, s.ID)
	require.Nil(t, in.Paused)
	require.Equal(t, saga.StatusCompleted, in.Status)
}

// A reason PostgreSQL cannot store (NUL bytes, 10 kB) is either refused
// with ErrInvalidInput ("ErrInvalidInput wraps every refusal of a caller's
// string that PostgreSQL could not store ... the error names the field")
// or stored so that it reads back; never a raw database error, never a
// half-paused saga.
func TestPauseHugeNulReason(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	d := saga.Define("p-reason", saga.Step[st]{Name: "a", Wait: saga.Sleep[st](time.Hour)})
	e := v.engine(t, false, d)
	s, err := saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	reason := strings.Repeat("r\x00", 5000) + "\xff"
	err = e.Pause(ctx, s.ID, reason)
	in := get(t, e, s.ID)
	if in.Paused != nil {
		t.Logf("pause with a 10 kB NUL reason: err=%v stored %d bytes: %.40q", err, len(in.Paused.Reason), in.Paused.Reason)
	}
	if err != nil {
		require.ErrorIs(t, err, saga.ErrInvalidInput)
		require.Contains(t, err.Error(), "reason")
		require.Nil(t, in.Paused, "a refused pause pauses nothing")
	} else {
		require.NotNil(t, in.Paused)
		require.NotEmpty(t, in.Paused.Reason)
		require.NotContains(t, in.Paused.Reason, "\x00")
	}
	// The same for a type's pause.
	_, err = e.PauseType(ctx, "p-reason", reason)
	t.Logf("PauseType: %v", err)
	if err != nil {
		require.ErrorIs(t, err, saga.ErrInvalidInput)
	}
	// And for a cancel reason on a saga (it is recorded in history).
	err = e.Cancel(ctx, s.ID, reason)
	t.Logf("Cancel: %v", err)
	if err != nil {
		require.ErrorIs(t, err, saga.ErrInvalidInput)
	}
}

// A second tenant (another schema) is not affected by a type's pause:
// "Other sagas, of this type or any other, are not held back." — here a
// saga of the same type name, in another schema, runs to its end.
func TestPauseTypeSecondTenant(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v1, v2 := newEnv(t), newEnv(t)
	mk := func(v *env) *saga.Definition[st] {
		return saga.Define("tenant", saga.Step[st]{Name: "a", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
			return v.fx.Record(ctx, run, "a")
		}})
	}
	d1, d2 := mk(v1), mk(v2)
	e1 := v1.engine(t, true, d1)
	e2 := v2.engine(t, true, d2)
	first, err := e1.PauseType(ctx, "tenant", "tenant 1 only")
	require.NoError(t, err)
	require.True(t, first)

	s2, err := saga.Start(ctx, e2, d2, st{}, nil)
	require.NoError(t, err)
	s1, err := saga.Start(ctx, e1, d1, st{}, nil)
	require.NoError(t, err)
	in2 := testkit.WaitEnded(t, e2, s2.ID)
	require.Equal(t, saga.StatusCompleted, in2.Status)
	types2, err := e2.PausedTypes(ctx)
	require.NoError(t, err)
	require.Empty(t, types2)

	testkit.Hold(t, time.Second, "tenant 1's saga stays held", func() bool { return v1.fx.Count(t, s1.ID, "a") == 0 })
	in1 := get(t, e1, s1.ID)
	require.NotNil(t, in1.Paused)
	require.True(t, in1.Paused.Type)
	ok, err := e1.ResumeType(ctx, "tenant")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, e1, s1.ID).Status)
}

// Engine.PauseType: "name need not be registered with this engine. It
// reports whether the type was not paused already." ResumeType: "It
// reports whether the type was paused."
func TestPauseTypeUnknownName(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	e := v.engine(t, false)
	first, err := e.PauseType(ctx, "never-registered", "just in case")
	require.NoError(t, err)
	require.True(t, first)
	again, err := e.PauseType(ctx, "never-registered", "twice")
	require.NoError(t, err)
	require.False(t, again)
	types, err := e.PausedTypes(ctx)
	require.NoError(t, err)
	require.Contains(t, types, "never-registered")
	require.True(t, types["never-registered"].Type)
	require.Equal(t, "just in case", types["never-registered"].Reason, "the first pause's reason stays")
	ok, err := e.ResumeType(ctx, "never-registered")
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = e.ResumeType(ctx, "never-registered")
	require.NoError(t, err)
	require.False(t, ok)
	types, err = e.PausedTypes(ctx)
	require.NoError(t, err)
	require.Empty(t, types)

	// ErrInvalidInput "wraps every refusal of a caller's string that
	// PostgreSQL could not store ...; the error names the field".
	for _, bad := range []string{"", "a\x00b", strings.Repeat("n", 10000)} {
		ok, err := e.PauseType(ctx, bad, "x")
		require.ErrorIs(t, err, saga.ErrInvalidInput, "%.12q", bad)
		require.Contains(t, err.Error(), "name")
		require.False(t, ok)
	}
	types, err = e.PausedTypes(ctx)
	require.NoError(t, err)
	require.Empty(t, types)
}

// Resume of a saga paused by its type only: "A saga whose type is paused
// (Engine.PauseType) stays held until Engine.ResumeType." PauseType: "and
// those started while the pause lasts". "Sagas paused on their own stay
// paused when the type's pause is lifted."
func TestResumeOfSagaPausedByTypeOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	d := saga.Define("p-type", saga.Step[st]{Name: "a", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
		return v.fx.Record(ctx, run, "a")
	}})
	e := v.engine(t, true, d)
	_, err := e.PauseType(ctx, "p-type", "deploy")
	require.NoError(t, err)
	byType, err := saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	own, err := saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	require.NoError(t, e.Pause(ctx, own.ID, "own pause"))

	in := get(t, e, byType.ID)
	require.NotNil(t, in.Paused, "a saga started during a type's pause is paused")
	require.True(t, in.Paused.Type)
	list, err := e.List(ctx, &saga.ListOpts{Paused: true})
	require.NoError(t, err)
	require.Len(t, list.Sagas, 2)

	// Resume of the type-paused saga does not run it (Resume: "an error
	// wrapping ErrNotReplayable for a saga that is not failed").
	require.ErrorIs(t, e.Resume(ctx, byType.ID, "try"), saga.ErrNotReplayable)
	testkit.Hold(t, time.Second, "the type-paused saga stays held after Resume", func() bool {
		return v.fx.Count(t, byType.ID, "a") == 0
	})
	ok, err := e.ResumeType(ctx, "p-type")
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, e, byType.ID).Status)
	testkit.Hold(t, time.Second, "a saga paused on its own stays paused", func() bool {
		return v.fx.Count(t, own.ID, "a") == 0
	})
	in = get(t, e, own.ID)
	require.NotNil(t, in.Paused)
	require.False(t, in.Paused.Type)
	require.NoError(t, e.Resume(ctx, own.ID, "now"))
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, e, own.ID).Status)
	require.Equal(t, 1, v.fx.Count(t, own.ID, "a"))
	require.Equal(t, 1, v.fx.Count(t, byType.ID, "a"))
}

// Step.PauseWhenExhausted: "pauses the saga for an operator when Action's
// retries are spent ... The saga keeps its position and records the last
// error; [Engine.Resume] runs the step again with its attempts counted
// afresh. A permanent error still compensates".
func TestPauseWhenExhausted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	var mu sync.Mutex
	fail := true
	attempts := map[int]int{}
	quick := &saga.RetryPolicy{MaxAttempts: 2, Backoff: func(int) time.Duration { return 10 * time.Millisecond }}
	d := saga.Define("p-exhaust",
		saga.Step[st]{Name: "a", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error { return v.fx.Record(ctx, run, "a") },
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *st) error { return v.fx.Record(ctx, run, "undo-a") }},
		saga.Step[st]{Name: "flaky", Retry: quick, PauseWhenExhausted: true,
			Action: func(ctx context.Context, run *saga.StepRun, s *st) error {
				mu.Lock()
				defer mu.Unlock()
				attempts[run.Attempt]++
				if s.Tag == "perm" {
					return steps.Permanent(errors.New("no such card"))
				}
				if fail {
					return errors.New("provider down")
				}
				return v.fx.Record(ctx, run, "flaky")
			}})
	e := v.engine(t, true, d)
	s, err := saga.Start(ctx, e, d, st{}, nil)
	require.NoError(t, err)
	in := sagatest.Wait(t, e, s.ID, sagatest.Cond("pause when exhausted", func(in *saga.Instance) bool {
		return in.Paused != nil
	}), nil)
	require.Equal(t, saga.PauseCodeExhausted, in.Paused.Code)
	require.Equal(t, "flaky", in.Paused.Step)
	require.Equal(t, "flaky", in.Step)
	require.Equal(t, saga.StatusRunning, in.Status)
	require.NotNil(t, in.LastError)
	require.Contains(t, in.LastError.Message, "provider down")
	testkit.Hold(t, 500*time.Millisecond, "no compensation", func() bool { return v.fx.Count(t, s.ID, "undo-a") == 0 })

	mu.Lock()
	fail = false
	mu.Unlock()
	require.NoError(t, e.Resume(ctx, s.ID, "provider back"))
	in = testkit.WaitEnded(t, e, s.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	mu.Lock()
	require.Equal(t, 2, attempts[1], "Resume counts attempts afresh: attempt 1 ran again")
	mu.Unlock()
	require.Equal(t, map[string]int{"a": 1, "flaky": 1}, v.fx.Counts(t, s.ID))

	// A permanent error still compensates.
	p, err := saga.Start(ctx, e, d, st{Tag: "perm"}, nil)
	require.NoError(t, err)
	in = testkit.WaitEnded(t, e, p.ID)
	require.Equal(t, saga.StatusCompensated, in.Status, sagatest.Describe(in))
	require.Equal(t, 1, v.fx.Count(t, p.ID, "undo-a"))
}
