package review31_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
)

// sized returns an order whose JSON encoding is exactly n bytes (n ≥ 30).
func sized(t *testing.T, n int) order {
	t.Helper()
	o := order{ID: "x", Pad: ""}
	base, _ := json.Marshal(order{ID: "x", Pad: "a"})
	o.Pad = strings.Repeat("a", n-len(base)+1)
	b, _ := json.Marshal(o)
	if len(b) != n {
		t.Fatalf("sized %d gave %d", n, len(b))
	}
	return o
}

// TestMaxStateBytesAtItsEdges: "MaxStateBytes bounds a saga's JSON-encoded
// state, at start and after each step"; ErrPayloadTooLarge "is returned
// when a saga's encoded state exceeds Config.MaxStateBytes"; a state that
// "grows past Config.MaxStateBytes, fails or compensates the saga with a
// coded error" (payload_too_large); a signal payload "larger than
// Config.MaxStateBytes" is refused wrapping ErrInvalidInput. With a limit
// of 200 bytes: a state of exactly 200 starts, 201 is refused; a step that
// leaves exactly 200 completes, one that leaves 201 compensates; a signal
// payload of exactly 200 is taken, 201 refused. With a limit of 1 byte no
// state starts (the smallest is "{}" and more).
func TestMaxStateBytesAtItsEdges(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	const limit = 200
	grow := func(n int) saga.StepFunc[order] {
		return func(_ context.Context, _ *saga.StepRun, s *order) error {
			*s = sized(t, n)
			return nil
		}
	}
	var handled atomic.Int32
	exact := saga.Define("r31-msb-exact",
		saga.Step[order]{Name: "a", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "grow", Action: grow(limit)})
	over := saga.Define("r31-msb-over",
		saga.Step[order]{Name: "a", Action: noop, Compensate: noop},
		saga.Step[order]{Name: "grow", Action: grow(limit + 1)})
	sig := saga.Define("r31-msb-sig",
		saga.Step[order]{Name: "await", Wait: saga.OnSignal("go", func(context.Context, *saga.StepRun, *order, json.RawMessage) error {
			handled.Add(1)
			return nil
		})})
	cfg := engineCfg(schema, nil)
	cfg.MaxStateBytes = limit
	e := startEngine(t, pool, cfg, exact, over, sig)
	ctx := context.Background()

	if _, err := saga.Start(ctx, e, exact, sized(t, limit+1), nil); !errors.Is(err, saga.ErrPayloadTooLarge) {
		t.Errorf("a state of limit+1 bytes: start returned %v, want ErrPayloadTooLarge", err)
	}
	st, err := saga.Start(ctx, e, exact, sized(t, limit), nil)
	if err != nil {
		t.Fatalf("a state of exactly the limit: %v", err)
	}
	if in := waitEnded(t, e, st.ID, 15*time.Second); in.Status != saga.StatusCompleted {
		t.Errorf("a step leaving exactly the limit: %s:\n%s", in.Status, timeline(in))
	}
	st, err = saga.Start(ctx, e, over, order{ID: "o"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if in := waitEnded(t, e, st.ID, 15*time.Second); in.Status != saga.StatusCompensated || in.LastError == nil || in.LastError.Code != saga.CodeTooLarge {
		t.Errorf("a step leaving limit+1 bytes: %s %+v:\n%s", in.Status, in.LastError, timeline(in))
	}

	st, err = saga.Start(ctx, e, sig, order{ID: "s"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	payload := func(n int) []byte {
		b, _ := json.Marshal(sized(t, n))
		return b
	}
	if _, err := e.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "go", Payload: payload(limit + 1)}); !errors.Is(err, saga.ErrInvalidInput) {
		t.Errorf("a signal payload of limit+1 bytes: %v, want ErrInvalidInput", err)
	}
	if _, err := e.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "go", Payload: payload(limit)}); err != nil {
		t.Errorf("a signal payload of exactly the limit: %v", err)
	}
	if in := waitEnded(t, e, st.ID, 15*time.Second); in.Status != saga.StatusCompleted || handled.Load() != 1 {
		t.Errorf("after the signal of exactly the limit: %s, handled %d:\n%s", in.Status, handled.Load(), timeline(in))
	}

	tiny, err := saga.New(pool, &saga.Config{Schema: schema, MaxStateBytes: 1, Logger: discard})
	if err != nil {
		t.Logf("MaxStateBytes 1 refused by New: %v", err)
		return
	}
	one := saga.Define("r31-msb-one", saga.Step[order]{Name: "a", Action: noop})
	if err := tiny.Register(one); err != nil {
		t.Fatal(err)
	}
	if _, err := saga.Start(ctx, tiny, one, order{}, nil); !errors.Is(err, saga.ErrPayloadTooLarge) {
		t.Errorf("MaxStateBytes 1: start returned %v, want ErrPayloadTooLarge", err)
	}
}

// TestManyWorkersOnASmallPool: Workers is "the number of goroutines that
// claim and run steps"; 200 of them on a pool of 4 connections start, run
// 30 sagas of two steps to completion, each step once, report healthy,
// log no error and stop.
func TestManyWorkersOnASmallPool(t *testing.T) {
	t.Parallel()
	_, schema := db(t)
	pool := pgtest.RecentPool(t, 4)
	lg := &logs{}
	var a, b counter
	def := saga.Define("r31-workers",
		saga.Step[order]{Name: "a", Action: a.step, Compensate: noop},
		saga.Step[order]{Name: "b", Action: b.step})
	cfg := engineCfg(schema, lg.logger())
	cfg.Workers = 200
	e := startEngine(t, pool, cfg, def)
	ctx := context.Background()
	var ids []uuid.UUID
	for i := range 30 {
		st, err := saga.Start(ctx, e, def, order{ID: fmt.Sprint(i)}, nil)
		if err != nil {
			t.Fatalf("start %d: %v", i, err)
		}
		ids = append(ids, st.ID)
	}
	for _, id := range ids {
		in := waitEnded(t, e, id, 30*time.Second)
		if in.Status != saga.StatusCompleted || a.of(id) != 1 || b.of(id) != 1 {
			t.Errorf("saga %s: %s, a %d, b %d", id, in.Status, a.of(id), b.of(id))
		}
	}
	if rep := e.Health(ctx); !rep.Live || !rep.Ready {
		t.Errorf("health: %+v", rep)
	}
	if errs := lg.errors(); len(errs) > 0 {
		t.Errorf("the engine logged %d errors, e.g. %q", len(errs), errs[:min(3, len(errs))])
	}
}
