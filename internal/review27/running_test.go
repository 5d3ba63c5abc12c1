package review27_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// holdRig is a saga "r27hold" whose step "hold" blocks in its handler until
// the test lets it go: reserve -> hold -> ship, each recording itself, the
// first two with compensations. With ignoreCtx the handler waits for the
// gate only, ignoring its context (and then returns success).
type holdRig struct {
	d    *testkit.DB
	fx   *testkit.Effects
	gate *testkit.Gate
	e    *saga.Engine
	def  *saga.Definition[payState]
	// release lets an ignoring handler return.
	release chan struct{}
	once    sync.Once
}

func newHoldRig(t *testing.T, ignoreCtx bool) *holdRig {
	t.Helper()
	h := &holdRig{d: testkit.NewDB(t), gate: testkit.NewGate(), release: make(chan struct{})}
	h.fx = testkit.NewEffects(t, h.d)
	t.Cleanup(h.gate.Open)
	t.Cleanup(h.open)
	rec := func(what string) saga.StepFunc[payState] {
		return func(ctx context.Context, run *saga.StepRun, _ *payState) error { return h.fx.Record(ctx, run, what) }
	}
	h.def = saga.Define("r27hold",
		saga.Step[payState]{Name: "reserve", Action: rec("reserve"), Compensate: rec("undo-reserve")},
		saga.Step[payState]{Name: "hold", Timeout: 30 * time.Second,
			Action: func(ctx context.Context, run *saga.StepRun, s *payState) error {
				if ignoreCtx {
					h.gate.Pass(context.Background())
					<-h.release
				} else if err := h.gate.Pass(ctx); err != nil {
					return err
				}
				return h.fx.Record(ctx, run, "hold")
			},
			Compensate: rec("undo-hold")},
		saga.Step[payState]{Name: "ship", Action: rec("ship")},
	)
	cfg := h.d.Config()
	cfg.HandlerGrace = 20 * time.Second
	h.e, _ = testkit.StartEngine(t, h.d.Pool, cfg, h.def)
	return h
}

func (h *holdRig) open() {
	h.once.Do(func() { close(h.release) })
	h.gate.Open()
}

// start starts a saga and waits until its "hold" handler is blocked.
func (h *holdRig) start(t *testing.T) uuid.UUID {
	t.Helper()
	n := h.gate.Entered()
	st, err := saga.Start(context.Background(), h.e, h.def, payState{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 20*time.Second, "the hold step's handler is blocked", func() bool { return h.gate.Entered() > n })
	return st.ID
}

// README: "Cancel lands. A cancel request is durable until applied, goes
// ahead of the saga's next step, cancels the running step's context (in
// whichever process runs it), and is recorded when received and when
// applied." From the CLI, while the step's handler is blocked: the handler's
// context is cancelled, the step is rolled back, reserve is compensated, and
// nothing after it runs.
func TestCancelWhileStepRunsLandsAfterTheStep(t *testing.T) {
	t.Parallel()
	h := newHoldRig(t, false)
	id := h.start(t)
	r := cli(t, h.d, "cancel", id.String(), "--reason", "customer asked")
	want(t, r, 0)
	in := testkit.WaitEnded(t, h.e, id)
	if in.Status != saga.StatusCompensated {
		t.Fatalf("cancelled saga ended %s: %v", in.Status, testkit.Timeline(in))
	}
	if h.gate.Left() != 1 {
		t.Fatalf("the running handler's context was not cancelled (left=%d)", h.gate.Left())
	}
	got := h.fx.Counts(t, id)
	if got["reserve"] != 1 || got["undo-reserve"] != 1 || got["hold"] != 0 || got["ship"] != 0 || got["undo-hold"] != 0 {
		t.Fatalf("effects %v, want reserve and undo-reserve once, nothing else: %v", got, testkit.Timeline(in))
	}
	if events(in, saga.EventCancelRequested) != 1 || events(in, saga.EventSagaCancelled) != 1 {
		t.Fatalf("want one cancel_requested and one saga_cancelled: %v", testkit.Timeline(in))
	}
	if in.LastError == nil || !strings.Contains(in.LastError.Message, "customer asked") {
		t.Fatalf("the reason is not the saga's last error: %+v", in.LastError)
	}
	// A second cancel of the ended saga: "A saga that is compensating or has
	// ended cannot be cancelled (exit code 1)".
	wantErr(t, cli(t, h.d, "cancel", id.String()), 1)
	jsonErr(t, cli(t, h.d, "cancel", id.String(), "--json"), 1)
}

// saga/doc.go (Cancel): "the step is rolled back, unless it returned success
// anyway, and then it is compensated too. No later step runs." A handler
// that ignores its context and returns success after the CLI's cancel.
func TestCancelWhileStepIgnoresContext(t *testing.T) {
	t.Parallel()
	h := newHoldRig(t, true)
	id := h.start(t)
	r := cli(t, h.d, "cancel", id.String(), "--reason", "stop it")
	want(t, r, 0)
	// The request is durable and visible while the step still runs.
	testkit.WaitFor(t, 10*time.Second, "cancel_requested in the history", func() bool {
		return events(get(t, h.e, id), saga.EventCancelRequested) == 1
	})
	time.Sleep(300 * time.Millisecond)
	h.open()
	in := testkit.WaitEnded(t, h.e, id)
	got := h.fx.Counts(t, id)
	if in.Status != saga.StatusCompensated || got["ship"] != 0 || got["undo-reserve"] != 1 || got["hold"] != got["undo-hold"] {
		t.Fatalf("status %s, effects %v: want compensated, no ship, every committed step undone: %v", in.Status, got, testkit.Timeline(in))
	}
	if events(in, saga.EventSagaCancelled) != 1 {
		t.Fatalf("want one saga_cancelled: %v", testkit.Timeline(in))
	}
}

// `sagaflow help`: "1 the operation failed: the saga is not replayable".
// Replay (resume, rerun, plan) of a saga whose step is running is refused
// with exit 1 and a clear message, records nothing, and the saga then runs
// to its end with each step once.
func TestReplayOfRunningSagaIsRefused(t *testing.T) {
	t.Parallel()
	h := newHoldRig(t, false)
	id := h.start(t)
	before := get(t, h.e, id)
	for _, args := range [][]string{
		{"replay", id.String()},
		{"replay", id.String(), "--reason", "again"},
		{"replay", id.String(), "--from-step", "reserve"},
		{"replay", id.String(), "--from-step", "hold"},
	} {
		r := cli(t, h.d, args...)
		wantErr(t, r, 1)
		low := strings.ToLower(r.stderr)
		if !strings.Contains(low, "running") && !strings.Contains(low, "replayable") && !strings.Contains(low, "not failed") && !strings.Contains(low, "not ended") {
			t.Errorf("%v: the refusal does not say why:\n%s", args, r)
		}
		jsonErr(t, cli(t, h.d, append(args, "--json")...), 1)
	}
	// The bulk form never picks a running saga.
	r := cli(t, h.d, "replay", "--bulk", "--status", "running", "--rate", "1000")
	wantErr(t, r, 2)
	after := get(t, h.e, id)
	if after.Epoch != before.Epoch || events(after, saga.EventSagaResumed)+events(after, saga.EventSagaRerun) != 0 {
		t.Fatalf("a refused replay changed the saga: %v", testkit.Timeline(after))
	}
	h.open()
	in := testkit.WaitEnded(t, h.e, id)
	got := h.fx.Counts(t, id)
	if in.Status != saga.StatusCompleted || got["reserve"] != 1 || got["hold"] != 1 || got["ship"] != 1 {
		t.Fatalf("status %s effects %v: %v", in.Status, got, testkit.Timeline(in))
	}
}

// `sagaflow help pause`: "a step that runs finishes, and no new step ...
// starts until unpause. Pausing a paused saga changes nothing." and
// `help unpause`: "A saga that is not paused is refused (exit code 1)."
func TestPauseWhileStepRunsThenUnpause(t *testing.T) {
	t.Parallel()
	h := newHoldRig(t, false)
	id := h.start(t)
	r := cli(t, h.d, "pause", id.String(), "--reason", "card processor incident")
	want(t, r, 0)
	r = cli(t, h.d, "pause", id.String(), "--reason", "again")
	want(t, r, 0)
	h.open()
	testkit.WaitFor(t, 10*time.Second, "the running step finished", func() bool { return h.fx.Count(t, id, "hold") == 1 })
	testkit.Hold(t, 1500*time.Millisecond, "no step after the pause", func() bool {
		return h.fx.Count(t, id, "ship") == 0
	})
	in := get(t, h.e, id)
	if in.Paused == nil || in.Status != saga.StatusRunning {
		t.Fatalf("paused saga: status %s paused %+v", in.Status, in.Paused)
	}
	if n := events(in, saga.EventSagaPaused); n != 1 {
		t.Fatalf("want one saga_paused entry after pausing twice, got %d: %v", n, testkit.Timeline(in))
	}
	lr := cli(t, h.d, "list", "--paused")
	want(t, lr, 0)
	if !strings.Contains(lr.stdout, id.String()) {
		t.Fatalf("list --paused misses the paused saga:\n%s", lr)
	}
	sr := cli(t, h.d, "show", id.String())
	want(t, sr, 0)
	if !strings.Contains(sr.stdout, "card processor incident") {
		t.Fatalf("show does not print the pause's reason:\n%s", sr)
	}
	r = cli(t, h.d, "unpause", id.String(), "--reason", "fixed")
	want(t, r, 0)
	in = testkit.WaitEnded(t, h.e, id)
	got := h.fx.Counts(t, id)
	if in.Status != saga.StatusCompleted || got["ship"] != 1 || got["hold"] != 1 || got["reserve"] != 1 {
		t.Fatalf("after unpause: %s %v %v", in.Status, got, testkit.Timeline(in))
	}
	wantErr(t, cli(t, h.d, "unpause", id.String()), 1)
	// "A saga that has ended cannot be paused (exit code 1)."
	wantErr(t, cli(t, h.d, "pause", id.String()), 1)
}

// saga/doc.go (Pause): "A cancel of a paused saga is applied at once (the
// saga turns compensating) and its compensations wait for the resume". From
// the CLI, which records a request: the request is kept, not lost, and the
// saga compensates once unpaused.
func TestCancelOfPausedSagaFromCLI(t *testing.T) {
	t.Parallel()
	h := newHoldRig(t, false)
	id := h.start(t)
	want(t, cli(t, h.d, "pause", id.String()), 0)
	h.open()
	testkit.WaitFor(t, 10*time.Second, "the running step finished", func() bool { return h.fx.Count(t, id, "hold") == 1 })
	want(t, cli(t, h.d, "cancel", id.String(), "--reason", "while paused"), 0)
	time.Sleep(500 * time.Millisecond)
	if got := h.fx.Counts(t, id); got["ship"] != 0 {
		t.Fatalf("a paused, cancelled saga shipped: %v", got)
	}
	want(t, cli(t, h.d, "unpause", id.String()), 0)
	in := testkit.WaitEnded(t, h.e, id)
	got := h.fx.Counts(t, id)
	if in.Status != saga.StatusCompensated || got["ship"] != 0 || got["undo-hold"] != 1 || got["undo-reserve"] != 1 {
		t.Fatalf("status %s effects %v: %v", in.Status, got, testkit.Timeline(in))
	}
}

// README: "A cancel request is durable until applied". The CLI records a
// cancel while a step runs whose handler ignores its context, and the engine
// running it is stopped at once (StopAndCancel, which gives up on the
// handler). With a new engine, the request is applied exactly once,
// whichever engine gets to it: the saga compensates, and no step after it
// runs.
func TestCancelSurvivesEngineStop(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	gate := testkit.NewGate()
	t.Cleanup(gate.Open)
	rec := func(what string) saga.StepFunc[payState] {
		return func(ctx context.Context, run *saga.StepRun, _ *payState) error { return fx.Record(ctx, run, what) }
	}
	def := saga.Define("r27hold",
		saga.Step[payState]{Name: "reserve", Action: rec("reserve"), Compensate: rec("undo-reserve")},
		saga.Step[payState]{Name: "hold", Timeout: 30 * time.Second, Action: func(ctx context.Context, run *saga.StepRun, _ *payState) error {
			// Ignores its context until the engine is killed.
			_ = gate.Pass(context.Background())
			return fx.Record(ctx, run, "hold")
		}, Compensate: rec("undo-hold")},
		saga.Step[payState]{Name: "ship", Action: rec("ship")},
	)
	cfg := d.PatientConfig(1)
	e := testkit.NewEngine(t, d.Pool, cfg, def)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := e.Start(ctx); err != nil {
		t.Fatal(err)
	}
	st, err := saga.Start(context.Background(), e, def, payState{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 20*time.Second, "hold runs", func() bool { return gate.Entered() == 1 })
	want(t, cli(t, d, "cancel", st.ID.String(), "--reason", "durable"), 0)
	stopCtx, stopCancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	_ = e.StopAndCancel(stopCtx) // the handler ignores ctx: the engine gives up on it
	stopCancel()
	gate.Open()
	cancel()
	_ = e.Stop(context.Background())

	e2, _ := testkit.StartEngine(t, d.Pool, d.Config(), def)
	in := testkit.WaitEnded(t, e2, st.ID)
	got := fx.Counts(t, st.ID)
	if in.Status != saga.StatusCompensated || got["ship"] != 0 || got["undo-reserve"] != 1 || got["hold"] != got["undo-hold"] {
		t.Fatalf("after the engine died with the request pending: %s %v %v", in.Status, got, testkit.Timeline(in))
	}
	if events(in, saga.EventCancelRequested) != 1 || events(in, saga.EventSagaCancelled) != 1 {
		t.Fatalf("want the request recorded once and applied once: %v", testkit.Timeline(in))
	}
}

// `help pause`: "--type name  pause every saga of this name, and those
// started while it is paused". A saga started during the type's pause runs
// no step until `unpause --type`.
func TestPauseTypeHoldsNewSagas(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	def := newWait("r27wait", fx)
	e, _ := testkit.StartEngine(t, d.Pool, d.Config(), def)
	want(t, cli(t, d, "pause", "--type", "r27wait", "--reason", "incident"), 0)
	st, err := saga.Start(context.Background(), e, def, payState{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	testkit.Hold(t, 1200*time.Millisecond, "no step of a saga started during its type's pause", func() bool {
		return fx.Count(t, st.ID, "reserve") == 0
	})
	lr := cli(t, d, "list", "--paused", "--json")
	want(t, lr, 0)
	if !strings.Contains(lr.stdout, st.ID.String()) {
		t.Fatalf("list --paused misses a saga held by its type's pause:\n%s", lr)
	}
	want(t, cli(t, d, "unpause", "--type", "r27wait"), 0)
	testkit.WaitFor(t, 20*time.Second, "reserve runs after unpause --type", func() bool { return fx.Count(t, st.ID, "reserve") == 1 })
}
