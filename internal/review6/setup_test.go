// Package review6_test is a black-box review of three features of package
// saga, written from their documentation only: pause, definition versions
// and parallel steps. Every test cites the sentence of saga/doc.go (or of a
// symbol's doc comment) that it checks.
package review6_test

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// st is the state of most sagas here.
type st struct {
	N    int    `json:"n"`
	Tag  string `json:"tag,omitempty"`
	Sum  int    `json:"sum,omitempty"`
	Note string `json:"note,omitempty"`
}

func noop(context.Context, *saga.StepRun, *st) error { return nil }

// env is one migrated schema with an effects table: every effect a step
// makes through run.Tx is a row there, so "exactly once" is a count.
type env struct {
	pool   *pgxpool.Pool
	schema string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE TABLE `+pgx.Identifier{schema, "effects"}.Sanitize()+
		` (saga_id uuid NOT NULL, what text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`)
	require.NoError(t, err)
	return &env{pool: pool, schema: schema}
}

func (v *env) config() *saga.Config {
	return &saga.Config{
		Schema:       v.schema,
		Workers:      8,
		PollInterval: 50 * time.Millisecond,
		Logger:       slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
}

// engine makes an engine with defs registered; start says whether its
// workers run (an engine never started is a client).
func (v *env) engine(t *testing.T, start bool, defs ...saga.AnyDefinition) *saga.Engine {
	t.Helper()
	return v.engineWith(t, v.config(), start, defs...)
}

func (v *env) engineWith(t *testing.T, cfg *saga.Config, start bool, defs ...saga.AnyDefinition) *saga.Engine {
	t.Helper()
	e, err := saga.New(v.pool, cfg)
	require.NoError(t, err)
	if len(defs) > 0 {
		require.NoError(t, e.Register(defs...))
	}
	if start {
		require.NoError(t, e.Start(context.Background()))
		t.Cleanup(func() {
			c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			_ = e.Stop(c)
		})
	}
	return e
}

// effect records what in the step's transaction.
func (v *env) effect(ctx context.Context, run *saga.StepRun, what string) error {
	_, err := run.Tx.Exec(ctx, `INSERT INTO `+pgx.Identifier{v.schema, "effects"}.Sanitize()+
		` (saga_id, what) VALUES ($1, $2)`, run.SagaID, what)
	return err
}

// count is how often saga id recorded what.
func (v *env) count(t *testing.T, id uuid.UUID, what string) int {
	t.Helper()
	var n int
	require.NoError(t, v.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+
		pgx.Identifier{v.schema, "effects"}.Sanitize()+` WHERE saga_id = $1 AND what = $2`, id, what).Scan(&n))
	return n
}

// counts is every effect of saga id, by what.
func (v *env) counts(t *testing.T, id uuid.UUID) map[string]int {
	t.Helper()
	rows, err := v.pool.Query(context.Background(), `SELECT what, count(*) FROM `+
		pgx.Identifier{v.schema, "effects"}.Sanitize()+` WHERE saga_id = $1 GROUP BY what`, id)
	require.NoError(t, err)
	out := map[string]int{}
	for rows.Next() {
		var w string
		var n int
		require.NoError(t, rows.Scan(&w, &n))
		out[w] = n
	}
	require.NoError(t, rows.Err())
	return out
}

// get reads saga id.
func get(t *testing.T, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	in, err := e.Get(context.Background(), id)
	require.NoError(t, err)
	return in
}

// hold checks, for d (a bounded window, as absence can only be observed
// for a while), that cond keeps holding; it fails at the first read where
// it does not.
func hold(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		if !cond() {
			t.Fatalf("did not keep holding: %s", what)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

// eventually polls cond until it holds or d passes.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	end := time.Now().Add(d)
	for !cond() {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting: %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// events counts the timeline entries of saga in (in sagatest.Timeline form)
// equal to entry; an entry without ":step" counts that event at any step.
func events(in *saga.Instance, entry string) int {
	n := 0
	for _, e := range sagatest.Timeline(in) {
		if e == entry || (!strings.Contains(entry, ":") && strings.HasPrefix(e, entry+":")) {
			n++
		}
	}
	return n
}

func waitEnded(t *testing.T, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	return sagatest.WaitEnded(t, e, id, &sagatest.WaitOpts{Timeout: 30 * time.Second})
}

// gate lets a test hold a step until it releases it.
type gate struct {
	entered chan struct{}
	release chan struct{}
}

func newGate() *gate { return &gate{entered: make(chan struct{}, 64), release: make(chan struct{})} }

func (g *gate) wait(ctx context.Context) error {
	g.entered <- struct{}{}
	select {
	case <-g.release:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (g *gate) waitEntered(t *testing.T) {
	t.Helper()
	select {
	case <-g.entered:
	case <-time.After(30 * time.Second):
		t.Fatal("step never entered")
	}
}
