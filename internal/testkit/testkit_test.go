package testkit_test

import (
	"context"
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/saga"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type order struct {
	ID string `json:"id"`
}

func TestNewDB(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	require.Zero(t, d.Count(t, `SELECT count(*) FROM `+d.Table("saga_instances")))

	// A second schema on the same pool, as a test of tenants makes it.
	_, other := pgtest.NewSchema(t)
	d2 := testkit.Migrate(t, d.Pool, other)
	require.Same(t, d.Pool, d2.Pool)
	require.Equal(t, `"`+other+`"."saga_instances"`, d2.Table("saga_instances"))
	require.Zero(t, d2.Count(t, `SELECT count(*) FROM `+d2.Table("saga_instances")))
}

func TestEffects(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	a, b := uuid.New(), uuid.New()
	require.NoError(t, pgx.BeginFunc(ctx, d.Pool, func(tx pgx.Tx) error {
		for _, w := range []string{"z", "a", "z"} {
			if err := fx.Record(ctx, &saga.StepRun{Tx: tx, SagaID: a}, w); err != nil {
				return err
			}
		}
		return fx.Record(ctx, &saga.StepRun{Tx: tx, SagaID: b}, "a")
	}))
	require.Equal(t, 2, fx.Count(t, a, "z"))
	require.Equal(t, 0, fx.Count(t, b, "z"))
	require.Equal(t, map[string]int{"z": 2, "a": 1}, fx.Counts(t, a))
	require.Equal(t, map[string]int{}, fx.Counts(t, uuid.New()))
	require.Equal(t, []string{"z", "a", "z"}, fx.List(t, a), "in insert order")
	require.Equal(t, 1, d.Count(t, `SELECT count(DISTINCT txid) FROM `+fx.Table()), "the writing transaction's id")
}

func TestEngine(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)
	def := saga.Define("order", saga.Step[order]{Name: "reserve",
		Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
			return fx.Record(ctx, run, "reserve")
		}})

	cfg := d.Config()
	require.Equal(t, d.Schema, cfg.Schema)
	require.Equal(t, testkit.PollInterval, cfg.PollInterval)
	require.NotSame(t, cfg, d.Config(), "each call returns a Config to change")

	client := testkit.NewEngine(t, d.Pool, d.Config(), def)
	st, err := saga.Start(ctx, client, def, order{ID: "o-1"}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusRunning, testkit.WaitStatus(t, d, st.ID, saga.StatusRunning).Status, "nothing runs it yet")

	e, stop := testkit.StartEngine(t, d.Pool, d.Config(), def)
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, e, st.ID).Status)
	require.Equal(t, saga.StatusCompleted, testkit.WaitStatus(t, d, st.ID, saga.StatusCompleted).Status)
	require.Equal(t, 1, fx.Count(t, st.ID, "reserve"))
	stop()
	stop() // and once more at cleanup: each does nothing
}

func TestWaitFor(t *testing.T) {
	t.Parallel()
	n := 0
	testkit.WaitFor(t, time.Second, "the third look", func() bool { n++; return n == 3 })
	require.Equal(t, 3, n)

	msg := fails(func(tb testing.TB) {
		testkit.WaitFor(tb, 50*time.Millisecond, "the impossible", func() bool { return false })
	})
	require.Equal(t, "timed out after 50ms waiting for the impossible", msg)
}

func TestHold(t *testing.T) {
	t.Parallel()
	n := 0
	testkit.Hold(t, 100*time.Millisecond, "the truth", func() bool { n++; return true })
	require.Greater(t, n, 1, "it looks more than once")

	msg := fails(func(tb testing.TB) {
		testkit.Hold(tb, time.Minute, "the second look", func() bool { n++; return n < 2 })
	})
	require.Equal(t, "did not keep holding for 1m0s: the second look", msg)
}

func TestRecv(t *testing.T) {
	t.Parallel()
	ch := make(chan int, 1)
	ch <- 7
	require.Equal(t, 7, testkit.Recv(t, ch, time.Second, "the seven"))

	msg := fails(func(tb testing.TB) { testkit.Recv(tb, ch, 50*time.Millisecond, "an eight") })
	require.Equal(t, "timed out after 50ms waiting for an eight", msg)
}

func TestGate(t *testing.T) {
	t.Parallel()
	g := testkit.NewGate()
	passed := make(chan error, 2)
	go func() { passed <- g.Pass(context.Background()) }()
	testkit.WaitFor(t, time.Second, "a handler at the gate", func() bool { return g.Entered() == 1 })
	testkit.Hold(t, 50*time.Millisecond, "the gate holding", func() bool { return len(passed) == 0 })
	g.Open()
	g.Open() // harmless
	require.NoError(t, testkit.Recv(t, passed, time.Second, "the handler through"))
	require.NoError(t, g.Pass(context.Background()), "an open gate lets later ones through at once")

	closed := testkit.NewGate()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, closed.Pass(ctx), context.Canceled, "a handler's context ends the wait")
}

func TestBuffer(t *testing.T) {
	t.Parallel()
	var b testkit.Buffer
	done := make(chan struct{})
	for range 4 {
		go func() {
			for range 100 {
				_, _ = b.Write([]byte("x"))
			}
			done <- struct{}{}
		}()
	}
	for range 4 {
		testkit.Recv(t, done, time.Second, "a writer")
	}
	require.Len(t, b.String(), 400)
}

func TestRandomLetters(t *testing.T) {
	t.Parallel()
	s := testkit.RandomLetters(10 << 10)
	require.Len(t, s, 10<<10)
	require.Equal(t, s, testkit.RandomLetters(10<<10), "the same on every call")
	require.Regexp(t, `^[a-zA-Z0-9]+$`, s)
}

// fails runs f with a testing.TB that records the message of its Fatalf
// and returns it ("" if f did not fail).
func fails(f func(tb testing.TB)) string {
	tb := &fatalTB{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		f(tb)
	}()
	<-done
	return tb.msg
}

// fatalTB is the part of testing.TB that the waits use. The embedded
// interface is nil: any other method panics.
type fatalTB struct {
	testing.TB
	msg string
}

func (tb *fatalTB) Helper() {}
func (tb *fatalTB) Fatalf(format string, args ...any) {
	tb.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// Relay publishes what is written to the schema's outbox, in order, and
// marks it published.
func TestRelay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "testkit.relay"))
	testkit.Relay(t, kc.Addrs(), d)
	ob, err := outbox.New(d.Pool, d.Schema)
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, d.Pool, func(tx pgx.Tx) error {
		for i := range 3 {
			if err := ob.InsertTx(ctx, tx, outbox.Message{Topic: "testkit.relay", Key: "k", Type: "t", Payload: []byte(fmt.Sprint(i))}); err != nil {
				return err
			}
		}
		return nil
	}))
	var got []string
	testkit.WaitFor(t, 15*time.Second, "the relay to publish three messages", func() bool {
		msgs, err := kc.ReadAll(ctx, "testkit.relay")
		require.NoError(t, err)
		got = got[:0]
		for _, m := range msgs {
			got = append(got, string(m.Value))
		}
		return len(got) == 3
	})
	require.Equal(t, []string{"0", "1", "2"}, got)
	testkit.WaitFor(t, 15*time.Second, "the rows to be marked published", func() bool {
		return d.Count(t, `SELECT count(*) FROM `+d.Table("outbox")+` WHERE status = 'pending'`) == 0
	})
}

// Hybrid carries a remote step's command to its participant and the reply
// back: the saga completes, and the participant's call is recorded once.
func TestHybrid(t *testing.T) {
	t.Parallel()
	h := testkit.NewHybrid(t, "kithybrid", "", nil)
	require.NoError(t, participant.Handle(h.Participant, "kithybrid.pay",
		func(ctx context.Context, tx pgx.Tx, c participant.Call[order]) (struct{}, error) {
			return struct{}{}, h.Record(ctx, tx, c.SagaID, "pay", c.Command.ID, 0, c.Key.String())
		}))
	h.Serve(t)
	def := saga.Define("kithybrid", saga.Step[order]{Name: "pay", Remote: &saga.Remote[order]{Topic: h.Topic, Type: "kithybrid.pay",
		Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil }}})
	e, _ := testkit.StartEngine(t, h.Orders.Pool, h.Config(), def)
	st, err := saga.Start(context.Background(), e, def, order{ID: "o-1"}, nil)
	require.NoError(t, err)
	in := testkit.WaitEnded(t, e, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, []string{"pay"}, h.Calls(t, st.ID))
}

// ActWhileHeld pauses or cancels a saga while its step is held at a gate,
// then lets the step go on: the step after it does not run.
func TestActWhileHeld(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	for _, op := range []string{"pause", "cancel"} {
		gate := testkit.NewGate()
		t.Cleanup(gate.Open)
		var after atomic.Int32
		def := saga.Define("kitheld"+op,
			saga.Step[order]{Name: "hold", Action: func(ctx context.Context, _ *saga.StepRun, _ *order) error {
				_ = gate.Pass(context.WithoutCancel(ctx))
				return nil
			}},
			saga.Step[order]{Name: "after", Action: func(context.Context, *saga.StepRun, *order) error { after.Add(1); return nil }})
		e, _ := testkit.StartEngine(t, d.Pool, d.Config(), def)
		st, err := saga.Start(context.Background(), e, def, order{ID: op}, nil)
		require.NoError(t, err)
		testkit.ActWhileHeld(t, e, st.ID, op, gate, 15*time.Second)
		if op == "cancel" {
			require.Equal(t, saga.StatusCompensated, testkit.WaitEnded(t, e, st.ID).Status)
		} else {
			in, err := e.Get(context.Background(), st.ID)
			require.NoError(t, err)
			require.NotNil(t, in.Paused, "paused while its step was held")
			testkit.Hold(t, 500*time.Millisecond, "the step after it waits while paused", func() bool { return after.Load() == 0 })
		}
		require.Zero(t, after.Load(), op)
	}
}
