// Package review4_test is an outside reviewer's black-box tests of the
// waiting features (timers, signals, child sagas, deadlines), written from
// the documentation only: README "Sagas that wait", saga/doc.go guarantee 12
// and go doc of packages saga and sagatest. What the review found was fixed
// or documented; a test whose message says "FIXED FINDING, BROKEN AGAIN"
// guards one of the fixes.
package review4_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// env is a migrated schema with an effects table that handlers write to
// through run.Tx, and an engine on it.
type env struct {
	pool   *pgxpool.Pool
	schema string
	e      *saga.Engine
}

// wopts bounds every wait of the package: generous, never a timing assertion.
var wopts = &sagatest.WaitOpts{Timeout: 30 * time.Second}

// newEnv migrates a fresh schema and returns an engine on it, not started.
func newEnv(t *testing.T) *env {
	t.Helper()
	ctx := context.Background()
	pool, schema := pgtest.Migrated(t)
	_, err := pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s.effects (saga_id uuid, what text)`,
		pgx.Identifier{schema}.Sanitize()))
	require.NoError(t, err)
	return &env{pool: pool, schema: schema, e: newEngine(t, pool, schema)}
}

func newEngine(t *testing.T, pool *pgxpool.Pool, schema string) *saga.Engine {
	t.Helper()
	e, err := saga.New(pool, &saga.Config{Schema: schema, PollInterval: 100 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	return e
}

// run registers defs and starts the engine until the test ends.
func (v *env) run(t *testing.T, defs ...saga.AnyDefinition) {
	t.Helper()
	startEngine(t, v.e, defs...)
}

func startEngine(t *testing.T, e *saga.Engine, defs ...saga.AnyDefinition) {
	t.Helper()
	require.NoError(t, e.Register(defs...))
	require.NoError(t, e.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, e.Stop(ctx))
	})
}

func (v *env) clock() *sagatest.Clock { return sagatest.NewClock(v.pool, v.schema, v.e) }

// effect records what in the effects table, in the step's transaction.
func (v *env) effect(ctx context.Context, run *saga.StepRun, what string) error {
	_, err := run.Tx.Exec(ctx, "INSERT INTO "+pgx.Identifier{v.schema}.Sanitize()+
		".effects (saga_id, what) VALUES ($1, $2)", run.SagaID, what)
	return err
}

// effects counts saga id's effects called what.
func (v *env) effects(t *testing.T, id uuid.UUID, what string) int {
	t.Helper()
	var n int
	require.NoError(t, v.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+
		pgx.Identifier{v.schema}.Sanitize()+".effects WHERE saga_id = $1 AND what = $2", id, what).Scan(&n))
	return n
}

// act is an action that records the step's name as its effect.
func act[S any](v *env, what string) saga.StepFunc[S] {
	return func(ctx context.Context, run *saga.StepRun, _ *S) error { return v.effect(ctx, run, what) }
}

// waitingFor waits until saga id waits for kind (and for, when not "").
func waitingFor(t *testing.T, e *saga.Engine, id uuid.UUID, kind, what string) *saga.Instance {
	t.Helper()
	return sagatest.Wait(t, e, id, sagatest.Cond("wait for "+kind+" "+what, func(in *saga.Instance) bool {
		return in.Wait != nil && in.Wait.Kind == kind && (what == "" || in.Wait.For == what)
	}), wopts)
}

func get(t *testing.T, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	in, err := e.Get(context.Background(), id)
	require.NoError(t, err)
	return in
}

// count returns how often entry appears in the saga's timeline.
func count(in *saga.Instance, entry string) int {
	n := 0
	for _, s := range sagatest.Timeline(in) {
		if s == entry {
			n++
		}
	}
	return n
}

func signals(t *testing.T, e *saga.Engine, id uuid.UUID) []saga.SignalInfo {
	t.Helper()
	s, err := e.Signals(context.Background(), id)
	require.NoError(t, err)
	return s
}

// sig sends a signal with a deadline, so that a Signal that blocks shows up
// as a failure instead of a hung test.
func sig(t *testing.T, e *saga.Engine, s saga.Signal) (saga.SignalResult, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	return e.Signal(ctx, s)
}

// gate is a step handler that blocks until released (or its context ends),
// telling the test when it runs.
type gate struct {
	running chan struct{}
	release chan struct{}
}

func newGate() *gate { return &gate{running: make(chan struct{}, 100), release: make(chan struct{})} }

func (g *gate) wait(ctx context.Context) error {
	g.running <- struct{}{}
	select {
	case <-g.release:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (g *gate) started(t *testing.T) {
	t.Helper()
	select {
	case <-g.running:
	case <-time.After(30 * time.Second):
		t.Fatal("gated step never ran")
	}
}

type state struct {
	Got []string `json:"got,omitempty"`
	N   int      `json:"n,omitempty"`
}

type ev struct {
	V string `json:"v"`
}

// appendSig is an OnSignal handler that records the payload in the state
// and as an effect.
func appendSig(v *env) func(context.Context, *saga.StepRun, *state, ev) error {
	return func(ctx context.Context, run *saga.StepRun, s *state, p ev) error {
		s.Got = append(s.Got, p.V)
		return v.effect(ctx, run, "sig:"+run.Step)
	}
}

// control starts a saga that sleeps d and waits for it to be asleep: once
// an Advance past d has completed it, the engine has handled that Advance,
// which is how a test proves that something did NOT happen after it.
func (v *env) controlDef() *saga.Definition[state] {
	return saga.Define("control",
		saga.Step[state]{Name: "nap", Wait: saga.Sleep[state](time.Minute)},
		saga.Step[state]{Name: "done", Action: act[state](v, "done")})
}

// poll reads saga id until met holds or d passes, and returns the saga as
// last read and whether met held: for tests that report a stuck saga as a
// finding instead of failing.
func poll(t *testing.T, e *saga.Engine, id uuid.UUID, d time.Duration, met func(*saga.Instance) bool) (*saga.Instance, bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		in := get(t, e, id)
		if met(in) {
			return in, true
		}
		if time.Now().After(deadline) {
			return in, false
		}
		time.Sleep(20 * time.Millisecond) // poll interval
	}
}
