// Package review6_test is a black-box review of three features of package
// saga, written from their documentation only: pause, definition versions
// and parallel steps. Every test cites the sentence of saga/doc.go (or of a
// symbol's doc comment) that it checks.
package review6_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
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
	*testkit.DB
	fx *testkit.Effects
}

func newEnv(t *testing.T) *env {
	t.Helper()
	d := testkit.NewDB(t)
	return &env{DB: d, fx: testkit.NewEffects(t, d)}
}

func (v *env) config() *saga.Config {
	cfg := v.Config()
	cfg.Workers = 8
	return cfg
}

// engine makes an engine with defs registered; start says whether its
// workers run (an engine never started is a client).
func (v *env) engine(t *testing.T, start bool, defs ...saga.AnyDefinition) *saga.Engine {
	t.Helper()
	return v.engineWith(t, v.config(), start, defs...)
}

func (v *env) engineWith(t *testing.T, cfg *saga.Config, start bool, defs ...saga.AnyDefinition) *saga.Engine {
	t.Helper()
	e := testkit.NewEngine(t, v.Pool, cfg, defs...)
	if start {
		testkit.Start(t, e)
	}
	return e
}

// get reads saga id.
func get(t *testing.T, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	in, err := e.Get(context.Background(), id)
	require.NoError(t, err)
	return in
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
	testkit.Recv(t, g.entered, 30*time.Second, "the step to be entered")
}
