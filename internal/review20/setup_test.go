// Package review20_test is a black-box review, written from the
// documentation only, of issue #17's latest round (CHANGELOG "Issue #17",
// first bullets of "Changed"; docs/architecture.md "One step, one
// transaction" and "Wake-ups come after the commit"):
//
//   - relay.NewKafkaWriter's BatchTimeout is 1 µs, each WriteMessages call's
//     messages for a partition still going in one produce request;
//   - the first notification after a quiet spell is sent at once, the next
//     a millisecond after the last, covering every commit made meanwhile;
//   - a Kafka-mode batch stops topping up when the reader holds nothing ready;
//   - a Postgres-only batch sends BEGIN with its claim, and its tail (release
//     the savepoints, delete the consumed commands, defer) with COMMIT: "a
//     statement of that tail that fails leaves the COMMIT unrun, and the
//     batch is rolled back"; a Kafka message's saga is read in its BEGIN's
//     pipeline.
//
// Every engine and relay polls once a minute and rescues once an hour, so
// that anything left to the poll shows as a saga that is not done within
// seconds. See FINDINGS.md.
package review20_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
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
	// poll is every engine's and relay's PollInterval here.
	poll = time.Minute
	// within bounds what the docs say runs at once (a wake-up, a
	// notification): far from a poll, generous on a loaded two-core machine
	// under -race.
	within = 15 * time.Second
	// wait bounds the set-up waits (a consumer group forming) and the
	// completion of a whole test's sagas.
	wait = 30 * time.Second
)

// st is every saga's state. Note and Raw carry the hostile bytes.
type st struct {
	ID   string          `json:"id"`
	Note string          `json:"note,omitempty"`
	Raw  json.RawMessage `json:"raw,omitempty"`
	Seen int             `json:"seen,omitempty"`
}

func backoff(n int, d time.Duration) *saga.RetryPolicy { return testkit.ConstantBackoff(n, d) }

// hookFn is run by a step's Action before it records its effect.
type hookFn func(ctx context.Context, run *saga.StepRun, s *st) error

// chain is a saga a (undo "a-undo") -> b (undo "b-undo") -> c whose every
// step records its effect through run.Tx in an effects table without a
// unique key, so that doubles show, after the test's hook for that saga and
// step. Calls counts the Action calls per "id/step".
type chain struct {
	db    *testkit.DB
	fx    *testkit.Effects
	def   *saga.Definition[st]
	calls testkit.Counter

	mu    sync.Mutex
	hooks map[string]hookFn // "<state id>/<step>" or "*/<step>"
}

func newChain(t *testing.T, db *testkit.DB, name string) *chain {
	t.Helper()
	c := &chain{db: db, fx: testkit.NewEffects(t, db), hooks: map[string]hookFn{}}
	step := func(n string, undo bool) saga.Step[st] {
		s := saga.Step[st]{Name: n, Retry: backoff(4, 50*time.Millisecond), Timeout: 20 * time.Second,
			Action: func(ctx context.Context, run *saga.StepRun, s *st) error {
				c.calls.Add(s.ID + "/" + n)
				if h := c.hook(s.ID, n); h != nil {
					if err := h(ctx, run, s); err != nil {
						return err
					}
				}
				return c.fx.Record(ctx, run, n)
			}}
		if undo {
			s.Compensate = func(ctx context.Context, run *saga.StepRun, _ *st) error { return c.fx.Record(ctx, run, n+"-undo") }
		}
		return s
	}
	c.def = saga.Define(name, step("a", true), step("b", true), step("c", false))
	return c
}

func (c *chain) hook(id, step string) hookFn {
	c.mu.Lock()
	defer c.mu.Unlock()
	if h := c.hooks[id+"/"+step]; h != nil {
		return h
	}
	return c.hooks["*/"+step]
}

func (c *chain) setHook(id, step string, h hookFn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.hooks[id+"/"+step] = h
}

// completed is what a chain saga's effects are after it completed.
var completed = map[string]int{"a": 1, "b": 1, "c": 1}

// compensatedAtC is what they are after c failed for good.
var compensatedAtC = map[string]int{"a": 1, "b": 1, "b-undo": 1, "a-undo": 1}

// patient is d's engine configuration: workers workers, BatchSize batch, a
// one-minute poll and an hourly rescuer.
func patient(d *testkit.DB, workers, batch int) *saga.Config {
	c := d.PatientConfig(workers)
	c.BatchSize = batch
	return c
}

// kafkaMode is patient in Kafka mode on kc.
func kafkaMode(d *testkit.DB, kc *kafkatest.Cluster, workers, batch int) *saga.Config {
	c := patient(d, workers, batch)
	c.Kafka = &saga.KafkaConfig{Brokers: kc.Addrs(), AllSteps: true, SessionTimeout: 6 * time.Second}
	return c
}

func endedWithin(t *testing.T, e *saga.Engine, id uuid.UUID, d time.Duration) *saga.Instance {
	t.Helper()
	return sagatest.WaitEnded(t, e, id, &sagatest.WaitOpts{Timeout: d})
}

func get(t *testing.T, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	in, err := e.Get(context.Background(), id)
	require.NoError(t, err)
	return in
}

// startMany starts n chain sagas with ids prefix0.. from the engines in
// turn, conc at a time, and returns their ids in that order.
func startMany(t *testing.T, def *saga.Definition[st], prefix string, n, conc int, from ...*saga.Engine) []uuid.UUID {
	t.Helper()
	ids := make([]uuid.UUID, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, conc)
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			s, err := saga.Start(context.Background(), from[i%len(from)], def, st{ID: fmt.Sprintf("%s%d", prefix, i)}, nil)
			ids[i], errs[i] = s.ID, err
		}()
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "start %s%d", prefix, i)
	}
	return ids
}

// effects is saga id's effects by what.
func (c *chain) effects(t *testing.T, id uuid.UUID) map[string]int { return c.fx.Counts(t, id) }

// doubles lists, over the whole effects table, (saga, what) pairs recorded
// more than once.
func doubles(t *testing.T, fx *testkit.Effects, d *testkit.DB) []string {
	t.Helper()
	rows, err := d.Pool.Query(context.Background(), `SELECT saga_id::text || ' ' || what || ' x' || count(*) FROM `+fx.Table()+
		` GROUP BY saga_id, what HAVING count(*) > 1`)
	require.NoError(t, err)
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		out = append(out, s)
	}
	require.NoError(t, rows.Err())
	sort.Strings(out)
	return out
}

func short(s string) string {
	if len(s) > 80 {
		s = s[:80] + "…"
	}
	return strings.ToValidUTF8(s, "?")
}
