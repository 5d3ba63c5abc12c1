// Package review14 is a black-box review, written from the documentation
// only, of commit 13c1264: when a wait ends (a signal delivered, a timer
// fired, a child's result applied) and the saga's next step is a local
// Action, the engine runs that step at once and writes the wait's end and
// the step's outcome in one update of the saga's row, with no command
// written for the step. See FINDINGS.md.
package review14

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// wait bounds every wait for a saga in this package.
const wait = 25 * time.Second

// ord is the sagas' state.
type ord struct {
	ID   string `json:"id"`
	Note string `json:"note,omitempty"`
	Got  string `json:"got,omitempty"` // what the wait handler took from its signal
}

// rig is a migrated schema with an effects table and a log of every row
// inserted into its outbox (outlog: saga_id, step_key, type), so that a
// test can see which commands were written.
type rig struct {
	db     *testkit.DB
	fx     *testkit.Effects
	engine *saga.Engine
}

func newRig(t *testing.T) *rig {
	t.Helper()
	ctx := context.Background()
	db := testkit.NewDB(t)
	r := &rig{db: db, fx: testkit.NewEffects(t, db)}
	fn := pgx.Identifier{db.Schema, "r14_outlog"}.Sanitize()
	for _, q := range []string{
		"CREATE TABLE " + db.Table("outlog") + " (seq bigint GENERATED ALWAYS AS IDENTITY, saga_id uuid, step_key text, type text)",
		"CREATE FUNCTION " + fn + "() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN INSERT INTO " + db.Table("outlog") +
			" (saga_id, step_key, type) VALUES (NEW.saga_id, NEW.step_key, NEW.type); RETURN NULL; END $$",
		"CREATE TRIGGER r14_outlog AFTER INSERT ON " + db.Table("outbox") + " FOR EACH ROW EXECUTE FUNCTION " + fn + "()",
	} {
		_, err := db.Pool.Exec(ctx, q)
		require.NoError(t, err, q)
	}
	return r
}

// start registers defs on a new Postgres-only engine and starts it.
func (r *rig) start(t *testing.T, mod func(*saga.Config), defs ...saga.AnyDefinition) {
	t.Helper()
	cfg := r.db.Config()
	cfg.Workers = 2
	if mod != nil {
		mod(cfg)
	}
	r.engine, _ = testkit.StartEngine(t, r.db.Pool, cfg, defs...)
}

func (r *rig) get(t *testing.T, id uuid.UUID) *saga.Instance {
	t.Helper()
	in, err := r.engine.Get(context.Background(), id)
	require.NoError(t, err)
	return in
}

func (r *rig) ended(t *testing.T, id uuid.UUID) *saga.Instance {
	t.Helper()
	return sagatest.WaitEnded(t, r.engine, id, &sagatest.WaitOpts{Timeout: wait})
}

// waiting waits until saga id waits at step (a wait recorded in its row).
func (r *rig) waiting(t *testing.T, id uuid.UUID, step string) *saga.Instance {
	t.Helper()
	return sagatest.Wait(t, r.engine, id, sagatest.Cond("wait at "+step, func(in *saga.Instance) bool {
		return in.Step == step && in.Wait != nil
	}), &sagatest.WaitOpts{Timeout: wait})
}

func (r *rig) signal(t *testing.T, id uuid.UUID, name, sigID string, payload any) saga.SignalResult {
	t.Helper()
	res, err := r.engine.Signal(context.Background(), saga.Signal{SagaID: id, Name: name, ID: sigID, Payload: payload})
	require.NoError(t, err)
	return res
}

func (r *rig) signals(t *testing.T, id uuid.UUID) []saga.SignalInfo {
	t.Helper()
	s, err := r.engine.Signals(context.Background(), id)
	require.NoError(t, err)
	return s
}

// commandsFor counts the outbox rows ever written for saga id's step
// (forward direction), by the outbox log.
func (r *rig) commandsFor(t *testing.T, id uuid.UUID, step string) int {
	t.Helper()
	return r.db.Count(t, "SELECT count(*) FROM "+r.db.Table("outlog")+" WHERE saga_id = $1 AND step_key LIKE $2",
		id, "%/"+step+"/forward/%")
}

// count is how often entry (Timeline form) is in the saga's timeline.
func count(in *saga.Instance, entry string) int {
	n := 0
	for _, e := range sagatest.Timeline(in) {
		if e == entry {
			n++
		}
	}
	return n
}

// before asserts that the timeline holds each entry, in this order.
func before(t *testing.T, in *saga.Instance, entries ...string) {
	t.Helper()
	tl := sagatest.Timeline(in)
	at := 0
	for _, want := range entries {
		found := false
		for at < len(tl) {
			at++
			if tl[at-1] == want {
				found = true
				break
			}
		}
		require.True(t, found, "timeline lacks %q in order %v:\n%s", want, entries, sagatest.Describe(in))
	}
}

func noBackoff(n int) *saga.RetryPolicy {
	return &saga.RetryPolicy{MaxAttempts: n, Backoff: func(int) time.Duration { return 10 * time.Millisecond }}
}

// rec is a step function that records what as an effect in run.Tx.
func rec(r *rig, what string) saga.StepFunc[ord] {
	return func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, what) }
}

// tally counts calls per key, safely across workers, and remembers values.
type tally struct {
	mu   sync.Mutex
	n    map[string]int
	seen map[string][]string
}

func (c *tally) add(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[key]++
	return c.n[key]
}

func (c *tally) get(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[key]
}

func (c *tally) snapshot() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string]int{}
	for k, v := range c.n {
		out[k] = v
	}
	return out
}

func (c *tally) note(key, v string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.seen == nil {
		c.seen = map[string][]string{}
	}
	c.seen[key] = append(c.seen[key], v)
}

func (c *tally) notes(key string) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.seen[key]...)
}

// awaitCancel gives the engine up to a second to cancel ctx.
func awaitCancel(ctx context.Context) {
	select {
	case <-ctx.Done():
	case <-time.After(time.Second):
	}
}

func describe(in *saga.Instance) string { return sagatest.Describe(in) }

// sleepers tracks handlers that sleep past their abandonment, so that a
// test ends only after they returned (goleak): each calls done once; the
// cleanup waits for n of them, at most 10 s.
type sleepers struct{ ch chan struct{} }

func newSleepers(t *testing.T, n int) *sleepers {
	s := &sleepers{ch: make(chan struct{}, n)}
	t.Cleanup(func() {
		deadline := time.After(10 * time.Second)
		for range n {
			select {
			case <-s.ch:
			case <-deadline:
				return
			}
		}
	})
	return s
}

func (s *sleepers) done() { s.ch <- struct{}{} }
