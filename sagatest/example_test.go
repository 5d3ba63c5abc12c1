package sagatest_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

type Checkout struct {
	OrderID  string `json:"order_id"`
	ChargeID string `json:"charge_id,omitempty"`
}

// This example is the body of a test (t stands for its *testing.T): a
// charge that fails is retried an hour later, and the test does not wait
// an hour.
func Example() {
	t, done := exampleT()
	defer done()
	pool, schema := exampleDB(t)
	ctx := context.Background()

	var calls atomic.Int32
	checkout := saga.Define("checkout",
		saga.Step[Checkout]{Name: "reserve", Action: func(context.Context, *saga.StepRun, *Checkout) error { return nil }},
		saga.Step[Checkout]{Name: "charge",
			Retry: &saga.RetryPolicy{MaxAttempts: 3, Backoff: func(int) time.Duration { return time.Hour }},
			Action: func(_ context.Context, run *saga.StepRun, c *Checkout) error {
				if calls.Add(1) == 1 {
					return errors.New("the provider is down")
				}
				c.ChargeID = "ch_" + c.OrderID
				return nil
			}},
	)
	engine, err := saga.New(pool, &saga.Config{Schema: schema})
	check(err)
	check(engine.Register(checkout))
	check(engine.Start(ctx))
	defer engine.Stop(ctx)

	st, err := saga.Start(ctx, engine, checkout, Checkout{OrderID: "o-1"}, nil)
	check(err)
	sagatest.Wait(t, engine, st.ID, sagatest.Event("step_failed:charge"), nil)
	begun := time.Now()
	check(sagatest.NewClock(pool, schema, engine).Advance(ctx, time.Hour))

	in := sagatest.WaitEnded(t, engine, st.ID, nil)
	sagatest.RequireTimeline(t, in, "saga_started", "step_completed:reserve", "step_failed:charge",
		"step_completed:charge", "saga_completed")
	fmt.Println(in.Status, "in less than a second:", time.Since(begun) < time.Second)
	fmt.Println(strings.Join(sagatest.Timeline(in), "\n"))
	// Output:
	// completed in less than a second: true
	// saga_started
	// step_completed:reserve
	// step_failed:charge
	// step_completed:charge
	// saga_completed
}

// RunStep runs one step in a transaction that is rolled back when the test
// ends; a failed step's writes are rolled back at once, as the engine does.
func ExampleRunStep() {
	t, done := exampleT()
	defer done()
	pool, schema := exampleDB(t)
	ctx := context.Background()
	stock := pgx.Identifier{schema, "stock"}.Sanitize()
	_, err := pool.Exec(ctx, "CREATE TABLE "+stock+" (order_id text)")
	check(err)

	reserve := saga.Step[Checkout]{Name: "reserve",
		Action: func(ctx context.Context, run *saga.StepRun, c *Checkout) error {
			if _, err := run.Tx.Exec(ctx, "INSERT INTO "+stock+" VALUES ($1)", c.OrderID); err != nil {
				return err
			}
			if c.OrderID == "o-sold-out" {
				return steps.Permanent(steps.WithCode("sold_out", errors.New("nothing left")))
			}
			return nil
		}}

	for _, id := range []string{"o-1", "o-sold-out"} {
		res := sagatest.RunStep(t, pool, reserve, Checkout{OrderID: id}, nil)
		var rows int
		check(res.Run.Tx.QueryRow(ctx, "SELECT count(*) FROM "+stock).Scan(&rows))
		fmt.Printf("%s: code %q, permanent %t, rows %d\n", id, steps.Code(res.Err), steps.IsPermanent(res.Err), rows)
	}
	// Output:
	// o-1: code "", permanent false, rows 1
	// o-sold-out: code "sold_out", permanent true, rows 0
}

// A fake payment service answers the saga's remote step over Kafka; the
// test then makes it refuse.
func ExampleNewParticipant() {
	t, done := exampleT()
	defer done()
	pool, schema := exampleDB(t)
	ctx := context.Background()
	kc, err := kafkatest.Start(kafkatest.SeedTopics(1, "sagaflow.commands.pay", "sagaflow.commands.pay.replies", "payments.commands"))
	check(err)
	defer kc.Close()
	w := relay.NewKafkaWriter(kc.Addrs(), nil) // the relay of the engine's commands
	defer w.Close()
	r, err := relay.New(pool, w, &relay.Config{Schema: schema})
	check(err)
	check(r.Start(ctx))
	defer r.Stop(ctx)

	pay := saga.Define("pay", saga.Step[Checkout]{Name: "charge", Remote: &saga.Remote[Checkout]{
		Topic: "payments.commands", Type: "payments.charge",
		Command: func(_ context.Context, _ *saga.StepRun, c *Checkout) (any, error) { return c, nil },
	}})
	payments := sagatest.NewParticipant(t, sagatest.ParticipantConfig{
		Brokers: kc.Addrs(), Topic: "payments.commands", Pool: pool, Schema: schema,
		Answers: map[string]sagatest.Answer{"payments.charge": sagatest.Reply(map[string]string{"id": "ch_1"})},
	})
	engine, err := saga.New(pool, &saga.Config{Schema: schema, Kafka: &saga.KafkaConfig{Brokers: kc.Addrs()}})
	check(err)
	check(engine.Register(pay))
	check(engine.Start(ctx))
	defer engine.Stop(ctx)

	for _, id := range []string{"o-1", "o-2"} {
		st, err := saga.Start(ctx, engine, pay, Checkout{OrderID: id}, nil)
		check(err)
		in := sagatest.WaitEnded(t, engine, st.ID, nil)
		fmt.Printf("%s: %s\n", id, in.Status)
		payments.Answer("payments.charge", sagatest.Refuse("card_declined", "declined"))
	}
	fmt.Println("charges asked:", len(payments.Calls()))
	// Output:
	// o-1: completed
	// o-2: compensated
	// charges asked: 2
}

// exampleDB is a fresh migrated schema, dropped when the example ends.
func exampleDB(t testing.TB) (*pgxpool.Pool, string) {
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(context.Background(), pool, schema)
	check(err)
	return pool, schema
}

// exampleT stands for a test's *testing.T in examples, which have none: a
// failure panics, and done runs the cleanups.
func exampleT() (testing.TB, func()) {
	t := &exampleTB{}
	return t, func() {
		for _, f := range slices.Backward(t.cleanups) {
			f()
		}
	}
}

type exampleTB struct {
	testing.TB // nil: a method not below panics
	cleanups   []func()
}

func (t *exampleTB) Helper()             {}
func (t *exampleTB) Cleanup(f func())    { t.cleanups = append(t.cleanups, f) }
func (t *exampleTB) Log(...any)          {}
func (t *exampleTB) Logf(string, ...any) {}
func (t *exampleTB) Errorf(format string, args ...any) {
	panic(fmt.Sprintf(format, args...))
}
func (t *exampleTB) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (t *exampleTB) Fatal(args ...any)                 { panic(fmt.Sprint(args...)) }

func check(err error) {
	if err != nil {
		panic(err)
	}
}
