package saga_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

type Order struct {
	ID       string `json:"id"`
	Amount   int    `json:"amount"`
	ChargeID string `json:"charge_id,omitempty"`
}

var errDeclined = errors.New("card declined")

// This example runs a checkout saga to completion and a second one whose
// card is declined, against a real PostgreSQL: the first completes, the
// second compensates its stock reservation.
func Example() {
	pool, schema, cleanup := pgtest.ForExample()
	defer cleanup()
	ctx := context.Background()
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		panic(err)
	}
	stock := pgx.Identifier{schema, "stock"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+stock+" (order_id text PRIMARY KEY)"); err != nil {
		panic(err)
	}

	checkout := saga.Define("checkout",
		saga.Step[Order]{
			Name: "reserve",
			Action: func(ctx context.Context, run *saga.StepRun, o *Order) error {
				// In the step's transaction: commits exactly when the step does.
				_, err := run.Tx.Exec(ctx, "INSERT INTO "+stock+" VALUES ($1)", o.ID)
				return err
			},
			Compensate: func(ctx context.Context, run *saga.StepRun, o *Order) error {
				_, err := run.Tx.Exec(ctx, "DELETE FROM "+stock+" WHERE order_id = $1", o.ID)
				return err
			},
		},
		saga.Step[Order]{
			Name: "charge",
			Action: func(ctx context.Context, run *saga.StepRun, o *Order) error {
				if o.Amount > 100 {
					return steps.Permanent(steps.WithCode("card_declined", errDeclined))
				}
				o.ChargeID = "ch_" + o.ID // a real provider would get run.IdempotencyKey()
				return nil
			},
		},
	)

	engine, err := saga.New(pool, &saga.Config{Schema: schema, PollInterval: 50 * time.Millisecond})
	if err != nil {
		panic(err)
	}
	if err := engine.Register(checkout); err != nil {
		panic(err)
	}
	if err := engine.Start(ctx); err != nil {
		panic(err)
	}
	defer engine.Stop(ctx)

	for _, o := range []Order{{ID: "o-1", Amount: 40}, {ID: "o-2", Amount: 400}} {
		st, err := saga.Start(ctx, engine, checkout, o, &saga.StartOpts{BusinessKey: o.ID})
		if err != nil {
			panic(err)
		}
		in := waitEnded(ctx, engine, st)
		var reserved int
		_ = pool.QueryRow(ctx, "SELECT count(*) FROM "+stock+" WHERE order_id = $1", o.ID).Scan(&reserved)
		fmt.Printf("%s: %s, stock rows %d", o.ID, in.Status, reserved)
		if in.LastError != nil {
			fmt.Printf(", %s at %s", in.LastError.Code, in.LastError.Step)
		}
		fmt.Println()
	}
	// Output:
	// o-1: completed, stock rows 1
	// o-2: compensated, stock rows 0, card_declined at charge
}

// StartTx starts a saga in the caller's transaction: the order row and
// the saga commit together, or neither does.
func ExampleStartTx() {
	pool, schema, cleanup := pgtest.ForExample()
	defer cleanup()
	ctx := context.Background()
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		panic(err)
	}
	orders := pgx.Identifier{schema, "orders"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+orders+" (id text PRIMARY KEY, saga_id uuid)"); err != nil {
		panic(err)
	}
	checkout := saga.Define("checkout", saga.Step[Order]{Name: "charge",
		Action: func(context.Context, *saga.StepRun, *Order) error { return nil }})
	engine, err := saga.New(pool, &saga.Config{Schema: schema})
	if err != nil {
		panic(err)
	}
	if err := engine.Register(checkout); err != nil {
		panic(err)
	}
	if err := engine.Start(ctx); err != nil {
		panic(err)
	}
	defer engine.Stop(ctx)

	// placeOrder is a request handler's body: it writes the order and starts
	// its saga in one transaction, and commits only when commit is true.
	placeOrder := func(o Order, commit bool) saga.Started {
		tx, err := pool.Begin(ctx)
		if err != nil {
			panic(err)
		}
		defer tx.Rollback(ctx)
		st, err := saga.StartTx(ctx, engine, tx, checkout, o, &saga.StartOpts{BusinessKey: o.ID})
		if err != nil {
			panic(err)
		}
		if st.Existing {
			return st // the order was placed before: write nothing
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+orders+" VALUES ($1, $2)", o.ID, st.ID); err != nil {
			panic(err)
		}
		if commit {
			if err := tx.Commit(ctx); err != nil {
				panic(err)
			}
		}
		return st
	}

	st := placeOrder(Order{ID: "o-1", Amount: 40}, true)
	fmt.Println("o-1:", waitEnded(ctx, engine, st).Status)
	again := placeOrder(Order{ID: "o-1", Amount: 40}, true)
	fmt.Println("o-1 again: existing", again.Existing, "same saga", again.ID == st.ID)
	lost := placeOrder(Order{ID: "o-2", Amount: 10}, false) // the handler failed after StartTx
	_, err = engine.Get(ctx, lost.ID)
	fmt.Println("o-2 rolled back: saga not found", errors.Is(err, saga.ErrNotFound))
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+orders).Scan(&n); err != nil {
		panic(err)
	}
	fmt.Println("orders:", n)
	// Output:
	// o-1: completed
	// o-1 again: existing true same saga true
	// o-2 rolled back: saga not found true
	// orders: 1
}

// Cancel stops a running saga: the steps that completed are compensated.
// Here the charge waits an hour for its retry when the customer cancels.
func ExampleEngine_Cancel() {
	pool, schema, cleanup := pgtest.ForExample()
	defer cleanup()
	ctx := context.Background()
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		panic(err)
	}
	checkout := saga.Define("checkout",
		saga.Step[Order]{Name: "reserve",
			Action:     func(context.Context, *saga.StepRun, *Order) error { return nil },
			Compensate: func(context.Context, *saga.StepRun, *Order) error { return nil },
		},
		saga.Step[Order]{Name: "charge",
			Action: func(context.Context, *saga.StepRun, *Order) error {
				return steps.RetryAfter(time.Hour, errors.New("the provider is down"))
			},
		},
	)
	engine, err := saga.New(pool, &saga.Config{Schema: schema})
	if err != nil {
		panic(err)
	}
	if err := engine.Register(checkout); err != nil {
		panic(err)
	}
	if err := engine.Start(ctx); err != nil {
		panic(err)
	}
	defer engine.Stop(ctx)

	st, err := saga.Start(ctx, engine, checkout, Order{ID: "o-1", Amount: 40}, nil)
	if err != nil {
		panic(err)
	}
	waitUntil(ctx, engine, st, func(in *saga.Instance) bool { return in.Attempt == 1 }) // charge failed once
	if err := engine.Cancel(ctx, st.ID, "the customer cancelled"); err != nil {
		panic(err)
	}
	in := waitEnded(ctx, engine, st)
	fmt.Println(in.Status)
	printTimeline(in)
	// Output:
	// compensated
	// saga_started reserve
	// step_completed reserve
	// step_failed charge
	// cancel_requested charge
	// saga_cancelled charge
	// compensation_started reserve
	// compensation_completed reserve
	// saga_compensated
}

// Resume restarts a failed saga where it failed, once the cause is fixed.
// Here the release of stock fails while the warehouse is offline.
func ExampleEngine_Resume() {
	pool, schema, cleanup := pgtest.ForExample()
	defer cleanup()
	ctx := context.Background()
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		panic(err)
	}
	var warehouseOnline atomic.Bool
	checkout := saga.Define("checkout",
		saga.Step[Order]{Name: "reserve",
			Action: func(context.Context, *saga.StepRun, *Order) error { return nil },
			Compensate: func(context.Context, *saga.StepRun, *Order) error {
				if !warehouseOnline.Load() {
					return steps.WithCode("warehouse_offline", errors.New("the warehouse does not answer"))
				}
				return nil
			},
			CompensateRetry: &saga.RetryPolicy{MaxAttempts: 1},
		},
		saga.Step[Order]{Name: "charge",
			Action: func(context.Context, *saga.StepRun, *Order) error {
				return steps.Permanent(steps.WithCode("card_declined", errDeclined))
			},
		},
	)
	engine, err := saga.New(pool, &saga.Config{Schema: schema, Logger: quiet})
	if err != nil {
		panic(err)
	}
	if err := engine.Register(checkout); err != nil {
		panic(err)
	}
	if err := engine.Start(ctx); err != nil {
		panic(err)
	}
	defer engine.Stop(ctx)

	st, err := saga.Start(ctx, engine, checkout, Order{ID: "o-1", Amount: 400}, nil)
	if err != nil {
		panic(err)
	}
	in := waitEnded(ctx, engine, st)
	fmt.Printf("%s: %s at %s\n", in.Status, in.LastError.Code, in.LastError.Step)

	warehouseOnline.Store(true) // the cause is fixed
	if err := engine.Resume(ctx, st.ID, "the warehouse is back"); err != nil {
		panic(err)
	}
	in = waitUntil(ctx, engine, st, func(in *saga.Instance) bool { return in.Status == saga.StatusCompensated })
	fmt.Printf("%s: %s at %s\n", in.Status, in.LastError.Code, in.LastError.Step)
	// Output:
	// failed: warehouse_offline at reserve
	// compensated: card_declined at charge
}

// Schedule starts a saga at every slot of a cron spec, once per slot
// however many engines run the schedule: here two engines share one.
func ExampleSchedule() {
	pool, schema, cleanup := pgtest.ForExample()
	defer cleanup()
	ctx := context.Background()
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		panic(err)
	}
	type Report struct {
		Kind string `json:"kind"`
	}
	report := saga.Define("report", saga.Step[Report]{Name: "send",
		Action: func(context.Context, *saga.StepRun, *Report) error { return nil }})
	for range 2 {
		engine, err := saga.New(pool, &saga.Config{Schema: schema})
		if err != nil {
			panic(err)
		}
		if err := engine.Register(report); err != nil {
			panic(err)
		}
		// In production: "0 6 * * *" (06:00 every day, in Config.Location).
		if err := saga.Schedule(engine, "@every 1s", report, Report{Kind: "sales"},
			&saga.ScheduleOpts{Name: "sales-report"}); err != nil {
			panic(err)
		}
		if err := engine.Start(ctx); err != nil {
			panic(err)
		}
		defer engine.Stop(ctx)
	}

	client, err := saga.New(pool, &saga.Config{Schema: schema}) // reads, never started
	if err != nil {
		panic(err)
	}
	var ended *saga.Instance
	for deadline := time.Now().Add(30 * time.Second); ended == nil; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			panic("no scheduled saga ended")
		}
		res, err := client.List(ctx, &saga.ListOpts{Name: "report", Statuses: []saga.Status{saga.StatusCompleted}})
		if err != nil {
			panic(err)
		}
		if len(res.Sagas) > 0 {
			ended = &res.Sagas[0]
		}
	}
	slot, ok := strings.CutPrefix(ended.BusinessKey, "cron:sales-report:")
	_, err = time.Parse(time.RFC3339, slot)
	fmt.Println(ended.Name, ended.Status, "business key cron:sales-report:<slot>", ok && err == nil)

	all, err := client.List(ctx, &saga.ListOpts{Name: "report"})
	if err != nil {
		panic(err)
	}
	perSlot := map[string]int{}
	most := 0
	for _, in := range all.Sagas {
		perSlot[in.BusinessKey]++
		most = max(most, perSlot[in.BusinessKey])
	}
	fmt.Println("sagas per slot:", most)
	// Output:
	// report completed business key cron:sales-report:<slot> true
	// sagas per slot: 1
}

// quiet is the logger of examples whose sagas fail on purpose.
var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// printTimeline prints each event of a saga's timeline with its step.
func printTimeline(in *saga.Instance) {
	for _, ev := range in.History {
		fmt.Println(strings.TrimSpace(ev.Type + " " + ev.Step))
	}
}

// waitEnded polls until the saga has ended. (In tests, sagatest.WaitEnded
// does this.)
func waitEnded(ctx context.Context, e *saga.Engine, st saga.Started) *saga.Instance {
	return waitUntil(ctx, e, st, func(in *saga.Instance) bool { return in.Status.Terminal() })
}

// waitUntil polls until the saga satisfies ok.
func waitUntil(ctx context.Context, e *saga.Engine, st saga.Started, ok func(*saga.Instance) bool) *saga.Instance {
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		in, err := e.Get(ctx, st.ID)
		if err != nil {
			panic(err)
		}
		if ok(in) {
			return in
		}
	}
	panic("the saga did not get there in 30s")
}
