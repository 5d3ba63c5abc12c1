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
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// db is a migrated schema with an effects table written by steps in
// run.Tx (no unique key: a doubled effect is a second row).
type db struct {
	*testkit.DB
	effects *testkit.Effects
}

func newDB(t *testing.T) *db {
	t.Helper()
	return withEffects(t, testkit.NewDB(t))
}

// migrate migrates schema, on pool, and adds the effects table.
func migrate(t *testing.T, pool *pgxpool.Pool, schema string) *db {
	t.Helper()
	return withEffects(t, testkit.Migrate(t, pool, schema))
}

func withEffects(t *testing.T, d *testkit.DB) *db {
	t.Helper()
	return &db{DB: d, effects: testkit.NewEffects(t, d)}
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
				_, err := run.Tx.Exec(ctx, `INSERT INTO `+d.effects.Table()+` (saga_id, what, tenant) VALUES ($1, $2, $3)`,
					run.SagaID, what, tenant)
				return err
			}})
	}
	return saga.Define(name, ss...)
}

func engineConfig(d *db) *saga.Config {
	cfg := d.Config()
	cfg.Workers = 2
	cfg.RescueInterval = time.Second
	return cfg
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
	rows, err := d.Pool.Query(context.Background(), `SELECT saga_id, what, count(*) FROM `+d.effects.Table()+` GROUP BY 1, 2`)
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
