package review34_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// TestRunStepAStepThatEndsItsTransaction: StepRun.Tx must not be committed
// or rolled back by the step; the engine refuses it ("a step must not commit
// or roll back its transaction"). RunStep runs a step "the way the engine
// would", and with a pool "nothing the step writes is ever committed". A
// step that commits run.Tx anyway must not get its writes committed for good
// by RunStep.
func TestRunStepAStepThatEndsItsTransaction(t *testing.T) {
	pool, schema := pgtest.Migrated(t)
	tbl := pgx.Identifier{schema, "r34_rows"}.Sanitize()
	if _, err := pool.Exec(context.Background(), "CREATE TABLE "+tbl+" (v text)"); err != nil {
		t.Fatal(err)
	}
	count := func(v string) int {
		var n int
		if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+tbl+" WHERE v = $1", v).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for _, c := range []struct {
		end  string // commit or rollback
		fail bool   // the step returns an error after it
	}{{"commit", true}, {"commit", false}, {"rollback", true}} {
		name := c.end + map[bool]string{true: "-then-fail", false: "-then-succeed"}[c.fail]
		t.Run(name, func(t *testing.T) {
			var endErrs []string
			step := saga.Step[order]{Name: "sneaky", Retry: &saga.RetryPolicy{MaxAttempts: 1},
				Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
					if _, err := run.Tx.Exec(ctx, "INSERT INTO "+tbl+" VALUES ($1)", o.ID); err != nil {
						return err
					}
					var err error
					if c.end == "commit" {
						err = run.Tx.Commit(ctx)
					} else {
						err = run.Tx.Rollback(ctx)
					}
					endErrs = append(endErrs, fmt.Sprint(err))
					if c.fail {
						return errors.New("failed after " + c.end)
					}
					return nil
				}}
			// The engine, as the reference.
			def := saga.Define("sneaky-"+name, step)
			e := engine(t, pool, &saga.Config{Schema: schema}, def)
			st, err := saga.Start(ctxT(t, 10*time.Second), e, def, order{ID: "engine-" + name}, nil)
			if err != nil {
				t.Fatal(err)
			}
			in := sagatest.WaitEnded(t, e, st.ID, &sagatest.WaitOpts{Timeout: 30 * time.Second})
			t.Logf("engine: %s, run.Tx.%s returned %q, %d rows kept", in.Status, c.end, endErrs, count("engine-"+name))
			endErrs = nil

			// RunStep, in a subtest so that its cleanup (the rollback of the
			// test transaction) has run when we look.
			var res sagatest.StepResult[order]
			var f *fakeTB
			var o outcome
			t.Run("runstep", func(t *testing.T) {
				f = newFake(t)
				o = call(15*time.Second, func() { res = sagatest.RunStep(f, pool, step, order{ID: "runstep-" + name}, nil) })
			})
			committed := count("runstep-" + name)
			t.Logf("RunStep: run.Tx.%s returned %q; err %v; failed=%v %q; rows committed after the test: %d",
				c.end, endErrs, res.Err, f.Failed(), f.messages(), committed)
			if o.panicked != nil || o.hung {
				t.Fatalf("RunStep: %+v", o)
			}
			if committed != 0 {
				t.Fatalf("RunStep let the step commit %d rows for good (the engine refuses run.Tx.%s: %s)", committed, c.end,
					"a step must not commit or roll back its transaction")
			}
			if len(endErrs) != 1 || !strings.Contains(endErrs[0], saga.ErrStepTxEnd.Error()) {
				t.Fatalf("run.Tx.%s returned %q in RunStep; the engine refuses it with saga.ErrStepTxEnd", c.end, endErrs)
			}
		})
	}
}

// TestRunStepMisuse: steps RunStep cannot run (no Action, a Wait, a
// Parallel, a missing Compensate) must fail the test clearly, not panic.
func TestRunStepMisuse(t *testing.T) {
	pool, _ := pgtest.Migrated(t)
	cases := []struct {
		name string
		step saga.Step[order]
		opts *sagatest.StepOpts
	}{
		{"zero step", saga.Step[order]{}, nil},
		{"no action", saga.Step[order]{Name: "x"}, nil},
		{"wait step", saga.Step[order]{Name: "w", Wait: saga.Sleep[order](time.Hour)}, nil},
		{"parallel step", saga.Step[order]{Name: "p", Parallel: &saga.Parallel[order]{Branches: []saga.Branch[order]{{Name: "a",
			Action: func(context.Context, *saga.StepRun, order) (any, error) { return nil, nil }}}}}, nil},
		{"compensate of a step without one", saga.Step[order]{Name: "c", Action: noop}, &sagatest.StepOpts{Direction: steps.Compensate}},
		{"bogus direction", saga.Step[order]{Name: "d", Action: noop}, &sagatest.StepOpts{Direction: "sideways"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFake(t)
			var res sagatest.StepResult[order]
			o := call(15*time.Second, func() { res = sagatest.RunStep(f, pool, c.step, order{ID: "m"}, c.opts) })
			t.Logf("%+v failed=%v %q err=%v", o, f.Failed(), f.messages(), res.Err)
			if o.panicked != nil {
				t.Fatalf("RunStep panicked: %v", o.panicked)
			}
			if o.hung {
				t.Fatal("RunStep hung")
			}
			if !f.Failed() && res.Err == nil {
				t.Fatalf("RunStep of %s passed with no error", c.name)
			}
		})
	}
}

// TestRunStepHostileStates: states with invalid UTF-8, 10 kB strings and
// the six characters \u0000 go through JSON as in the engine; a state of
// exactly MaxStateBytes passes and one byte more fails.
func TestRunStepHostileStates(t *testing.T) {
	pool, _ := pgtest.Migrated(t)
	set := func(v string) saga.Step[order] {
		return saga.Step[order]{Name: "set", Action: func(_ context.Context, _ *saga.StepRun, o *order) error { o.Pad = v; return nil }}
	}
	res := sagatest.RunStep(t, pool, set("a\xffb"+strings.Repeat("é", 5000)), order{ID: "x\xfe"}, nil)
	if res.Err != nil {
		t.Fatalf("invalid UTF-8: %v", res.Err)
	}
	if !utf8.ValidString(res.State.Pad) || !utf8.ValidString(res.State.ID) || !strings.Contains(res.State.Pad, "\ufffd") {
		t.Errorf("invalid UTF-8 did not become U+FFFD through JSON: %.20q %q", res.State.Pad, res.State.ID)
	}
	res = sagatest.RunStep(t, pool, set(`\u0000`), order{ID: "y"}, nil)
	if res.Err != nil || res.State.Pad != `\u0000` {
		t.Errorf("the text \\u0000 (no NUL): %v %q", res.Err, res.State.Pad)
	}
	// {"id":"z","pad":"…"} is 19 bytes plus the pad.
	const limit = 1000
	for _, n := range []int{limit - 19, limit - 18} {
		res = sagatest.RunStep(t, pool, set(strings.Repeat("p", n)), order{ID: "z"}, &sagatest.StepOpts{MaxStateBytes: limit})
		fits := n+19 <= limit
		t.Logf("pad %d (state %d bytes): %v", n, n+19, res.Err)
		if fits && res.Err != nil {
			t.Errorf("a state of %d bytes, at MaxStateBytes %d, failed: %v", n+19, limit, res.Err)
		}
		if !fits && (res.Err == nil || steps.Code(res.Err) != saga.CodeTooLarge) {
			t.Errorf("a state of %d bytes, over MaxStateBytes %d: %v", n+19, limit, res.Err)
		}
	}
	// Odd StepOpts: negative sizes and attempts must not panic or pass
	// what the engine would refuse.
	for _, o := range []*sagatest.StepOpts{{MaxStateBytes: -1}, {Attempt: -5}, {Epoch: math.MinInt32}, {SagaName: strings.Repeat("n", 10_000)}} {
		f := newFake(t)
		var r sagatest.StepResult[order]
		out := call(15*time.Second, func() { r = sagatest.RunStep(f, pool, set("q"), order{ID: "o"}, o) })
		t.Logf("opts %+v: %+v failed=%v %q err=%v", *o, out, f.Failed(), f.messages(), r.Err)
		if out.panicked != nil || out.hung {
			t.Errorf("RunStep with %+v: %+v", *o, out)
		}
	}
}
