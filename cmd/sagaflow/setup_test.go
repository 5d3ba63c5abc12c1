package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// order is the state of the fixture saga "order": reserve, charge, ship.
type order struct {
	ID string `json:"id"`
	// Decline makes charge fail for good, so the saga compensates.
	Decline bool `json:"decline,omitempty"`
	// BreakRelease makes the compensation of reserve fail for good, so a
	// declined saga ends failed.
	BreakRelease bool `json:"break_release,omitempty"`
}

// defineOrder returns the order saga. Its fixed version ignores Decline and
// BreakRelease: the bug an operator waits to be deployed before replaying.
func defineOrder(fixed bool) *saga.Definition[order] {
	ok := func(context.Context, *saga.StepRun, *order) error { return nil }
	return saga.Define("order",
		saga.Step[order]{Name: "reserve", Action: ok,
			Compensate: func(_ context.Context, _ *saga.StepRun, o *order) error {
				if o.BreakRelease && !fixed {
					return steps.Permanent(steps.WithCode("release_broken", errors.New("stock service refused the release")))
				}
				return nil
			}},
		saga.Step[order]{Name: "charge", Action: func(_ context.Context, _ *saga.StepRun, o *order) error {
			if o.Decline && !fixed {
				return steps.Permanent(steps.WithCode("card_declined", errors.New("card declined")))
			}
			return nil
		}},
		saga.Step[order]{Name: "ship", Action: ok},
	)
}

// definePing returns a one-step saga, to have a second saga name.
func definePing() *saga.Definition[order] {
	return saga.Define("ping", saga.Step[order]{Name: "pong",
		Action: func(context.Context, *saga.StepRun, *order) error { return nil }})
}

// fixture is a migrated schema and how the CLI reaches it.
type fixture struct {
	*testkit.DB
	url string
}

func setup(t *testing.T) *fixture {
	t.Helper()
	return &fixture{DB: testkit.NewDB(t), url: pgtest.ConnString(t)}
}

// engine returns an engine (not started) with the order and ping sagas.
func (f *fixture) engine(t *testing.T, fixed bool) (*saga.Engine, *saga.Definition[order], *saga.Definition[order]) {
	t.Helper()
	orderDef, pingDef := defineOrder(fixed), definePing()
	return testkit.NewEngine(t, f.Pool, f.Config(), orderDef, pingDef), orderDef, pingDef
}

// ended are the sagas of populate, by how they ended.
type ended struct {
	completed, compensated, failed1, failed2, ping uuid.UUID
}

// populate runs sagas to each end with the buggy order saga, then stops
// the engine: two failed, one compensated, one completed order, and one
// completed ping.
func (f *fixture) populate(t *testing.T) ended {
	t.Helper()
	ctx := context.Background()
	e, orderDef, pingDef := f.engine(t, false)
	stop := testkit.Start(t, e)
	startOrder := func(o order) uuid.UUID {
		st, err := saga.Start(ctx, e, orderDef, o, &saga.StartOpts{BusinessKey: o.ID})
		require.NoError(t, err)
		return st.ID
	}
	var s ended
	s.completed = startOrder(order{ID: "o-ok"})
	s.compensated = startOrder(order{ID: "o-declined", Decline: true})
	s.failed1 = startOrder(order{ID: "o-stuck-1", Decline: true, BreakRelease: true})
	s.failed2 = startOrder(order{ID: "o-stuck-2", Decline: true, BreakRelease: true})
	st, err := saga.Start(ctx, e, pingDef, order{ID: "p-1"}, nil)
	require.NoError(t, err)
	s.ping = st.ID

	testkit.WaitStatus(t, f.DB, s.completed, saga.StatusCompleted)
	testkit.WaitStatus(t, f.DB, s.compensated, saga.StatusCompensated)
	testkit.WaitStatus(t, f.DB, s.failed1, saga.StatusFailed)
	testkit.WaitStatus(t, f.DB, s.failed2, saga.StatusFailed)
	testkit.WaitStatus(t, f.DB, s.ping, saga.StatusCompleted)
	stop()
	return s
}

// status reads a saga's status with SQL.
func (f *fixture) status(t *testing.T, id uuid.UUID) saga.Status {
	t.Helper()
	var s string
	require.NoError(t, f.Pool.QueryRow(context.Background(),
		"SELECT status FROM "+f.Table("saga_instances")+" WHERE id = $1", id).Scan(&s))
	return saga.Status(s)
}

// statuses reads every saga's status with SQL.
func (f *fixture) statuses(t *testing.T) map[uuid.UUID]string {
	t.Helper()
	rows, err := f.Pool.Query(context.Background(), "SELECT id, status FROM "+f.Table("saga_instances"))
	require.NoError(t, err)
	out := map[uuid.UUID]string{}
	var id uuid.UUID
	var s string
	_, err = pgx.ForEachRow(rows, []any{&id, &s}, func() error { out[id] = s; return nil })
	require.NoError(t, err)
	return out
}

// result is what one CLI run printed and returned.
type result struct {
	code           int
	stdout, stderr string
}

// runCLI runs the CLI in-process with env as its whole environment.
func runCLI(t *testing.T, env map[string]string, args ...string) result {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(context.Background(), args, &out, &errOut, func(k string) string { return env[k] })
	return result{code: code, stdout: out.String(), stderr: errOut.String()}
}

// cli runs the CLI against the fixture's schema.
func (f *fixture) cli(t *testing.T, args ...string) result {
	t.Helper()
	return runCLI(t, nil, append([]string{"--database-url", f.url, "--schema", f.Schema}, args...)...)
}

// ok requires exit code 0 and returns stdout.
func (r result) ok(t *testing.T) string {
	t.Helper()
	require.Equal(t, exitOK, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	require.Empty(t, r.stderr)
	return r.stdout
}

// failed requires exit code want and returns stderr.
func (r result) failed(t *testing.T, want int) string {
	t.Helper()
	require.Equal(t, want, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	require.True(t, strings.HasPrefix(r.stderr, "sagaflow: "), "stderr: %s", r.stderr)
	return r.stderr
}

// decode decodes the run's stdout, which must be one JSON document.
func decode[T any](t *testing.T, r result) T {
	t.Helper()
	var v T
	dec := json.NewDecoder(strings.NewReader(r.stdout))
	require.NoError(t, dec.Decode(&v), "stdout: %s", r.stdout)
	require.False(t, dec.More(), "more than one JSON document: %s", r.stdout)
	return v
}

// requireInOrder requires the substrings to occur in s in the given order.
func requireInOrder(t *testing.T, s string, subs ...string) {
	t.Helper()
	rest := s
	for _, sub := range subs {
		i := strings.Index(rest, sub)
		require.GreaterOrEqual(t, i, 0, "%q missing or out of order in:\n%s", sub, s)
		rest = rest[i+len(sub):]
	}
}
