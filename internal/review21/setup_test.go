// Package review21 is a black-box review, written from the documentation
// only, of a batch that reads a saga's cancel request and pauses again
// before that saga's command runs, when the batch read the saga more than
// 100 ms before (saga/doc.go guarantee 10 "Cancel lands", "Pause";
// CHANGELOG "Fixed", first entry). See FINDINGS.md.
//
// Every engine polls once a minute and rescues once an hour (a patient
// engine), so a cancel or pause that the batch does not hear of, or read
// again, is not rescued by a poll within the test.
package review21

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// TestMain runs four tests at once unless -parallel says otherwise.
func TestMain(m *testing.M) { pgtest.MainParallel(m, 4) }

const (
	// within bounds what the docs say happens at once (a resume, a
	// completion), on a loaded machine under -race: far below the poll.
	within = 20 * time.Second
	// aged is how long the test keeps the batch's head step held after the
	// operator's write, so that every later saga of the batch was read
	// more than 100 ms before its turn (the documented threshold).
	aged = 300 * time.Millisecond
)

type ord struct {
	ID string `json:"id"`
}

// rig is one tenant: a schema with the saga
//
//	a (compensation a-undo) -> b (compensation b-undo) -> c
//
// whose Actions count their calls (and their transaction) before they
// record an effect through run.Tx. The first call of step gateStep, of
// any saga, is held at gate: the head of its batch.
type rig struct {
	name     string
	db       *testkit.DB
	fx       *testkit.Effects
	def      *saga.Definition[ord]
	client   *saga.Engine // knows the definition, never started: starts sagas
	ops      *saga.Engine // an operator tool: no definition, never started
	kc       *kafkatest.Cluster
	gate     *testkit.Gate
	gateStep string

	head atomic.Pointer[uuid.UUID]
	// onHead, when set, runs in the head's step after the gate opens.
	onHead atomic.Pointer[func(ctx context.Context, run *saga.StepRun) error]
	mu     sync.Mutex
	calls  map[string]int    // saga/step -> calls
	txs    map[string]string // saga/step -> txid of the last call
	after  map[string]int    // saga/step -> calls after the saga's operator acted
	acted  map[uuid.UUID]bool
	// at is when each saga/step's handler was last called, actedAt when
	// each saga's operator acted: for failure messages.
	at      map[string]time.Time
	actedAt map[uuid.UUID]time.Time
}

// newRig builds a tenant on d (a fresh schema when nil). With kc, its
// sagas run in Kafka mode (KafkaConfig.AllSteps) on kc, whose topic for
// name must exist, with a relay.
func newRig(t *testing.T, d *testkit.DB, name, gateStep string, kc *kafkatest.Cluster) *rig {
	t.Helper()
	if d == nil {
		d = testkit.NewDB(t)
	}
	r := &rig{name: name, db: d, fx: testkit.NewEffects(t, d), kc: kc, gate: testkit.NewGate(), gateStep: gateStep,
		calls: map[string]int{}, txs: map[string]string{}, after: map[string]int{}, acted: map[uuid.UUID]bool{},
		at: map[string]time.Time{}, actedAt: map[uuid.UUID]time.Time{}}
	t.Cleanup(r.gate.Open)
	step := func(n string, comp bool) saga.Step[ord] {
		s := saga.Step[ord]{Name: n, Timeout: 2 * time.Minute, Retry: testkit.ConstantBackoff(3, 10*time.Millisecond),
			Action: func(ctx context.Context, run *saga.StepRun, _ *ord) error {
				var tx string
				if err := run.Tx.QueryRow(ctx, "SELECT pg_current_xact_id()::text").Scan(&tx); err != nil {
					return err
				}
				r.count(run.SagaID, n, tx)
				if n == r.gateStep {
					id := run.SagaID
					if r.head.CompareAndSwap(nil, &id) {
						if err := r.gate.Pass(ctx); err != nil {
							return err
						}
						if f := r.onHead.Load(); f != nil {
							if err := (*f)(ctx, run); err != nil {
								return err
							}
						}
					}
				}
				return r.fx.Record(ctx, run, n)
			}}
		if comp {
			s.Compensate = func(ctx context.Context, run *saga.StepRun, _ *ord) error {
				r.count(run.SagaID, n+"-undo", "")
				return r.fx.Record(ctx, run, n+"-undo")
			}
		}
		return s
	}
	r.def = saga.Define(name, step("a", true), step("b", true), step("c", false))
	r.client = testkit.NewEngine(t, d.Pool, r.config(), r.def)
	r.ops = testkit.NewEngine(t, d.Pool, &saga.Config{Schema: d.Schema, Logger: testkit.Discard})
	if kc != nil {
		testkit.Relay(t, kc.Addrs(), d)
	}
	return r
}

func (r *rig) count(id uuid.UUID, step, tx string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	k := id.String() + "/" + step
	r.calls[k]++
	r.at[k] = time.Now()
	if tx != "" {
		r.txs[k] = tx
	}
	if r.acted[id] {
		r.after[k]++
	}
}

// actedOn notes that an operator is about to act on saga id: its calls
// from now on count as "after".
func (r *rig) actedOn(id uuid.UUID) {
	r.mu.Lock()
	r.acted[id] = true
	r.actedAt[id] = time.Now()
	r.mu.Unlock()
}

// explain says when saga id's step ran, relative to its operator and to
// the head, and whether it ran in the head's transaction.
func (r *rig) explain(id uuid.UUID, step string) string {
	same := r.sameTx(id, step)
	r.mu.Lock()
	defer r.mu.Unlock()
	k := id.String() + "/" + step
	return fmt.Sprintf("called %s after the operator acted, in the head's transaction: %v, txid %s, head's txid %s",
		r.at[k].Sub(r.actedAt[id]), same, r.txs[k], r.headTx())
}

func (r *rig) headTx() string {
	h := r.head.Load()
	if h == nil {
		return ""
	}
	return r.txs[h.String()+"/"+r.gateStep]
}

func (r *rig) callsOf(id uuid.UUID, step string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls[id.String()+"/"+step]
}

func (r *rig) afterOf(id uuid.UUID, step string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.after[id.String()+"/"+step]
}

// sameTx reports whether saga id's last call of step ran in the
// transaction of the head's call of gateStep: in its batch.
func (r *rig) sameTx(id uuid.UUID, step string) bool {
	h := r.head.Load()
	r.mu.Lock()
	defer r.mu.Unlock()
	if h == nil {
		return false
	}
	tx := r.txs[id.String()+"/"+step]
	return tx != "" && tx == r.txs[h.String()+"/"+r.gateStep]
}

// config is a patient engine of one worker, BatchSize 16, in Kafka mode
// when the rig has a cluster.
func (r *rig) config() *saga.Config {
	c := r.db.PatientConfig(1)
	c.BatchSize = 16
	if r.kc != nil {
		c.Kafka = &saga.KafkaConfig{Brokers: r.kc.Addrs(), AllSteps: true, SessionTimeout: 6 * time.Second}
	}
	return c
}

// startN starts n sagas (no engine runs yet), with ids when given.
func (r *rig) startN(t *testing.T, n int, ids []uuid.UUID) []uuid.UUID {
	t.Helper()
	out := make([]uuid.UUID, n)
	for i := range n {
		var o *saga.StartOpts
		if ids != nil {
			o = &saga.StartOpts{ID: ids[i]}
		}
		st, err := saga.Start(context.Background(), r.client, r.def, ord{ID: fmt.Sprint(i)}, o)
		require.NoError(t, err)
		out[i] = st.ID
	}
	if r.kc != nil {
		r.waitOnTopic(t, out)
	}
	return out
}

func (r *rig) waitOnTopic(t *testing.T, ids []uuid.UUID) {
	t.Helper()
	testkit.WaitFor(t, within, "the commands on the topic", func() bool {
		msgs, err := r.kc.ReadAll(context.Background(), saga.CommandTopicDefault+"."+r.name)
		require.NoError(t, err)
		seen := map[string]bool{}
		for _, m := range msgs {
			seen[string(m.Key)] = true
		}
		for _, id := range ids {
			if !seen[id.String()] {
				return false
			}
		}
		return true
	})
}

// run starts the engine and waits for the head of the gated batch; it
// returns the engine, the head and the others of ids.
func (r *rig) run(t *testing.T, ids []uuid.UUID) (*saga.Engine, uuid.UUID, []uuid.UUID) {
	t.Helper()
	e, _ := testkit.StartEngine(t, r.db.Pool, r.config(), r.def)
	t.Cleanup(r.gate.Open) // before the engine stops
	testkit.WaitFor(t, within, "the head of the batch at the gate", func() bool { return r.gate.Entered() == 1 })
	head := *r.head.Load()
	var mates []uuid.UUID
	for _, id := range ids {
		if id != head {
			mates = append(mates, id)
			require.Zero(t, r.callsOf(id, r.gateStep), "a batch mate's %s ran before the head's", r.gateStep)
		}
	}
	return e, head, mates
}

// openAged opens the gate once every later saga of the batch has been read
// more than 100 ms before: aged after the operators acted.
func (r *rig) openAged(t *testing.T) {
	t.Helper()
	time.Sleep(aged)
	require.Zero(t, r.gate.Left(), "the head left the gate by its context before it was opened")
	r.gate.Open()
}

// sqlCancel writes a cancel request row for id at its epoch, with no
// notification: a notification lost.
func (r *rig) sqlCancel(t *testing.T, id uuid.UUID, reason string) {
	t.Helper()
	r.actedOn(id)
	_, err := r.db.Pool.Exec(context.Background(), `INSERT INTO `+r.db.Table("saga_cancel_requests")+
		` (saga_id, epoch, reason) SELECT id, epoch, $2 FROM `+r.db.Table("saga_instances")+` WHERE id = $1`, id, reason)
	require.NoError(t, err)
}

// sqlPause writes a pause row for id (or, with id nil, for the type), with
// no notification.
func (r *rig) sqlPause(t *testing.T, id *uuid.UUID, reason string) {
	t.Helper()
	kind := "type"
	if id != nil {
		kind = "saga"
		r.actedOn(*id)
	}
	_, err := r.db.Pool.Exec(context.Background(), `INSERT INTO `+r.db.Table("saga_pauses")+
		` (kind, saga_id, saga_name, code, reason) VALUES ($1, $2, $3, 'operator', $4)`, kind, id, r.name, reason)
	require.NoError(t, err)
}

func get(t *testing.T, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	in, err := e.Get(context.Background(), id)
	require.NoError(t, err)
	return in
}

func opCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	t.Cleanup(cancel)
	return ctx
}

// completedOnce: saga id completed, each step's Action called once and its
// effect once, nothing undone.
func (r *rig) completedOnce(t *testing.T, e *saga.Engine, id uuid.UUID) {
	t.Helper()
	in := sagatest.WaitEnded(t, e, id, &sagatest.WaitOpts{Timeout: within})
	require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v", id, testkit.Timeline(in))
	require.Equal(t, map[string]int{"a": 1, "b": 1, "c": 1}, r.fx.Counts(t, id), "%s: effects (%v)", id, testkit.Timeline(in))
	for _, s := range []string{"a", "b", "c"} {
		require.Equal(t, 1, r.callsOf(id, s), "%s: calls of %s (%v)", id, s, testkit.Timeline(in))
	}
}

// cancelledClean: saga id ended compensated by one cancel; no Action of it
// was called after its operator acted, and each completed step was undone
// once.
func (r *rig) cancelledClean(t *testing.T, e *saga.Engine, id uuid.UUID) {
	t.Helper()
	in := sagatest.WaitEnded(t, e, id, &sagatest.WaitOpts{Timeout: within})
	tl := testkit.Timeline(in)
	require.Equal(t, saga.StatusCompensated, in.Status, "%s: %v", id, tl)
	require.Equal(t, 1, countType(in, "saga_cancelled"), "%s: %v", id, tl)
	for _, s := range []string{"a", "b", "c"} {
		require.Zero(t, r.afterOf(id, s), "%s: step %s's handler was called after the cancel was recorded (%s; %v)", id, s, r.explain(id, s), tl)
	}
	c := r.fx.Counts(t, id)
	require.Equal(t, c["a"], c["a-undo"], "%s: every a undone once (%v, %v)", id, c, tl)
	require.Equal(t, c["b"], c["b-undo"], "%s: every b undone once (%v, %v)", id, c, tl)
	require.LessOrEqual(t, c["a"], 1, "%s: %v", id, tl)
	require.Zero(t, c["c"], "%s: %v", id, tl)
}

// heldPaused: saga id stays paused and running, its step gateStep not
// called, while others finish (checked for d).
func (r *rig) heldPaused(t *testing.T, e *saga.Engine, id uuid.UUID, d time.Duration) {
	t.Helper()
	testkit.Hold(t, d, "the paused saga starts no step", func() bool {
		in := get(t, e, id)
		return in.Paused != nil && in.Status == saga.StatusRunning && r.afterOf(id, "a")+r.afterOf(id, "b")+r.afterOf(id, "c") == 0
	})
}

func countType(in *saga.Instance, typ string) int {
	n := 0
	for _, e := range in.History {
		if e.Type == typ {
			n++
		}
	}
	return n
}

// caseTenants makes two schemas whose names differ only in case, migrated
// on one pool, dropped when the test ends.
func caseTenants(t *testing.T) (*testkit.DB, *testkit.DB) {
	t.Helper()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pgtest.ConnString(t))
	require.NoError(t, err)
	suffix := strings.ReplaceAll(uuid.NewString(), "-", "")[:12]
	names := []string{"rv21_" + suffix, "RV21_" + suffix}
	for _, s := range names {
		_, err := pool.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{s}.Sanitize())
		require.NoError(t, err)
	}
	t.Cleanup(func() {
		pool.Close()
		conn, err := pgx.Connect(context.Background(), pgtest.ConnString(t))
		if err != nil {
			t.Errorf("drop tenants: %v", err)
			return
		}
		defer conn.Close(context.Background())
		for _, s := range names {
			if _, err := conn.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{s}.Sanitize()+` CASCADE`); err != nil {
				t.Errorf("drop %s: %v", s, err)
			}
		}
	})
	return testkit.Migrate(t, pool, names[0]), testkit.Migrate(t, pool, names[1])
}
