package saga_test

import (
	"context"
	"errors"
	"fmt"
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

func waitEnded(ctx context.Context, e *saga.Engine, st saga.Started) *saga.Instance {
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		in, err := e.Get(ctx, st.ID)
		if err != nil {
			panic(err)
		}
		if in.Status.Terminal() {
			return in
		}
	}
	panic("saga did not end")
}
