// Package review9_test is a black-box review, written from the
// documentation only, of two recent changes: concurrent saga.Start calls
// sharing commits (saga/doc.go "Starts share commits", Stats.StartsGrouped,
// docs/architecture.md) and the rescuer releasing commands held for a pause
// that no longer exists (RescueResult.Released, Stats.Released). See
// FINDINGS.md.
package review9_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func randomLetters(n int) string {
	const letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
	b := make([]byte, n)
	x := uint64(88172645463325252)
	for i := range b {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b[i] = letters[x%uint64(len(letters))]
	}
	return string(b)
}

// db is a migrated schema with an effects table written by steps in
// run.Tx (no unique key: a doubled effect is a second row).
type db struct {
	pool   *pgxpool.Pool
	schema string
}

func newDB(t *testing.T) *db {
	t.Helper()
	pool, schema := pgtest.NewSchema(t)
	return migrate(t, pool, schema)
}

func migrate(t *testing.T, pool *pgxpool.Pool, schema string) *db {
	t.Helper()
	ctx := context.Background()
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	d := &db{pool: pool, schema: schema}
	_, err = pool.Exec(ctx, `CREATE TABLE `+d.table("effects")+
		` (seq bigint GENERATED ALWAYS AS IDENTITY, saga_id uuid NOT NULL, what text NOT NULL, tenant text)`)
	require.NoError(t, err)
	return d
}

func (d *db) table(name string) string { return pgx.Identifier{d.schema, name}.Sanitize() }

func (d *db) count(t *testing.T, q string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, d.pool.QueryRow(context.Background(), q, args...).Scan(&n))
	return n
}

// order is the saga state; Tenant lets a step check it runs in the right
// schema.
type order struct {
	Key    string `json:"key"`
	Tenant string `json:"tenant,omitempty"`
	Note   string `json:"note,omitempty"`
}

// probe records, in memory, when each step's handler was entered.
type probe struct {
	mu      sync.Mutex
	entries map[uuid.UUID][]time.Time
}

func newProbe() *probe { return &probe{entries: map[uuid.UUID][]time.Time{}} }

func (p *probe) enter(id uuid.UUID) {
	p.mu.Lock()
	p.entries[id] = append(p.entries[id], time.Now())
	p.mu.Unlock()
}

// between lists saga id's handler entries in [from, to].
func (p *probe) between(id uuid.UUID, from, to time.Time) []time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []time.Time
	for _, at := range p.entries[id] {
		if !at.Before(from) && !at.After(to) {
			out = append(out, at)
		}
	}
	return out
}

// stepTimeout is the Timeout of orderDef's steps.
var stepTimeout = 10 * time.Second

// orderDef is a saga of n local steps; each writes one effect row
// (saga id, step, tenant) in run.Tx, after sleeping stepSleep.
func orderDef(d *db, name, tenant string, n int, stepSleep time.Duration, p *probe) *saga.Definition[order] {
	var ss []saga.Step[order]
	for i := 0; i < n; i++ {
		step := fmt.Sprintf("s%d", i+1)
		ss = append(ss, saga.Step[order]{Name: step, Timeout: stepTimeout,
			Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
				if p != nil {
					p.enter(run.SagaID)
				}
				if stepSleep > 0 {
					select {
					case <-time.After(stepSleep):
					case <-ctx.Done():
						return ctx.Err()
					}
				}
				what := step
				if tenant != "" && o.Tenant != tenant {
					what = step + ":wrong-tenant:" + o.Tenant
				}
				_, err := run.Tx.Exec(ctx, `INSERT INTO `+d.table("effects")+` (saga_id, what, tenant) VALUES ($1, $2, $3)`,
					run.SagaID, what, tenant)
				return err
			}})
	}
	return saga.Define(name, ss...)
}

func engineConfig(d *db) *saga.Config {
	return &saga.Config{
		Schema:         d.schema,
		Workers:        2,
		PollInterval:   50 * time.Millisecond,
		RescueInterval: time.Second,
		Logger:         quiet,
	}
}

// newEngine makes an engine with defs registered; started says whether
// its workers run (an engine never started is a client).
func newEngine(t *testing.T, pool *pgxpool.Pool, cfg *saga.Config, started bool, defs ...saga.AnyDefinition) *saga.Engine {
	t.Helper()
	e, err := saga.New(pool, cfg)
	require.NoError(t, err)
	require.NoError(t, e.Register(defs...))
	if started {
		require.NoError(t, e.Start(context.Background()))
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			require.NoError(t, e.Stop(ctx))
		})
	}
	return e
}

// allSagas lists every saga of name through the public API.
func allSagas(t *testing.T, e *saga.Engine, name string) []saga.Instance {
	t.Helper()
	var out []saga.Instance
	opts := &saga.ListOpts{Name: name, Limit: saga.ListLimitMax}
	for {
		res, err := e.List(context.Background(), opts)
		require.NoError(t, err)
		out = append(out, res.Sagas...)
		if res.NextCursor == "" {
			return out
		}
		opts.Cursor = res.NextCursor
	}
}

// waitAllCompleted waits until every saga of name has completed.
func waitAllCompleted(t *testing.T, e *saga.Engine, name string, want int, d time.Duration) {
	t.Helper()
	end := time.Now().Add(d)
	for {
		all := allSagas(t, e, name)
		done := 0
		var notDone []string
		for _, in := range all {
			if in.Status == saga.StatusCompleted {
				done++
			} else if len(notDone) < 5 {
				p := ""
				if in.Paused != nil {
					p = fmt.Sprintf(" paused(type=%v)", in.Paused.Type)
				}
				notDone = append(notDone, fmt.Sprintf("%s %s at %s%s", in.ID, in.Status, in.Step, p))
			}
		}
		if len(all) == want && done == want {
			return
		}
		if time.Now().After(end) {
			t.Fatalf("after %s: %d sagas of %s, %d completed (want %d); e.g. %v", d, len(all), name, done, want, notDone)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// requireEffectsOnce checks that each saga in ids has exactly one effect
// per step s1..sn and that no other effect exists.
func (d *db) requireEffectsOnce(t *testing.T, ids map[uuid.UUID]bool, n int) {
	t.Helper()
	rows, err := d.pool.Query(context.Background(), `SELECT saga_id, what, count(*) FROM `+d.table("effects")+` GROUP BY 1, 2`)
	require.NoError(t, err)
	type eff struct {
		ID   uuid.UUID
		What string
		N    int
	}
	effs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[eff])
	require.NoError(t, err)
	per := map[uuid.UUID]int{}
	var bad []string
	for _, e := range effs {
		if e.N != 1 {
			bad = append(bad, fmt.Sprintf("%s %s ×%d", e.ID, e.What, e.N))
		}
		if !ids[e.ID] {
			bad = append(bad, fmt.Sprintf("%s %s: effect of an unknown saga", e.ID, e.What))
		}
		per[e.ID]++
	}
	for id := range ids {
		if per[id] != n {
			bad = append(bad, fmt.Sprintf("%s: %d distinct steps ran, want %d", id, per[id], n))
		}
	}
	sort.Strings(bad)
	if len(bad) > 10 {
		bad = append(bad[:10], fmt.Sprintf("… %d more", len(bad)-10))
	}
	require.Empty(t, bad, "every started saga runs each step exactly once")
}

// durations summarises latencies.
func durations(ds []time.Duration) string {
	if len(ds) == 0 {
		return "none"
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return fmt.Sprintf("n=%d p50=%s p90=%s max=%s", len(s), s[len(s)/2].Round(time.Microsecond),
		s[len(s)*9/10].Round(time.Microsecond), s[len(s)-1].Round(time.Microsecond))
}

func isCtxErr(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}
