// Package review35_test is an outside reviewer's black-box tests of remote
// steps (saga.Remote) and the settings around them at their extremes, over
// the in-process Kafka cluster (internal/kafkatest) with a real participant
// (sagatest.NewParticipant, the real participant runtime) and a relay:
// KafkaConfig.ReplyStepLimit, a remote step's Timeout, late, duplicate and
// stale replies, hostile and huge Commands, OnReply's errors and panics,
// and CompensateRetry for a remote compensation. Written from the
// documentation only (README.md, CHANGELOG.md, docs/*.md, go doc of saga,
// participant, inbox, relay, sagatest); the non-test sources of the public
// packages were not read.
package review35_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

func TestMain(m *testing.M) { pgtest.MainParallel(m, 2) }

var discard = slog.New(slog.DiscardHandler)

const (
	svcTopic   = "svc.commands"
	replyTopic = "sagaflow.commands.pay.replies"
)

type order struct {
	ID  string `json:"id"`
	Pad string `json:"pad,omitempty"`
	Got string `json:"got,omitempty"`
}

func noop(context.Context, *saga.StepRun, *order) error { return nil }

// rig is a schema, a kfake cluster, a relay on the schema, a fake
// participant of svcTopic and an engine in the hybrid mode running def.
type rig struct {
	pool   *pgxpool.Pool
	schema string
	kc     *kafkatest.Cluster
	e      *saga.Engine
	def    *saga.Definition[order]
	p      *sagatest.Participant
	regErr error // with rigOpts.mayRefuse: what New or Register returned
}

type rigOpts struct {
	cfg     saga.Config // Schema, Kafka.Brokers filled in
	answers map[string]sagatest.Answer
	relay   *relay.Config // Schema filled in
	// mayRefuse: New's or Register's error is kept in rig.regErr (and the
	// rig has no engine) instead of failing the test.
	mayRefuse bool
}

func newRig(t *testing.T, def *saga.Definition[order], o rigOpts) *rig {
	t.Helper()
	r := &rig{def: def}
	r.pool, r.schema = pgtest.Migrated(t)
	r.kc = kafkatest.New(t, kafkatest.SeedTopics(1, "sagaflow.commands.pay", replyTopic, svcTopic),
		kafkatest.AllowAutoTopicCreation())
	ctx := context.Background()
	w := relay.NewKafkaWriter(r.kc.Addrs(), nil)
	t.Cleanup(func() { w.Close() })
	rc := o.relay
	if rc == nil {
		rc = &relay.Config{}
	}
	rc.Schema, rc.Logger = r.schema, discard
	if rc.PollInterval == 0 {
		rc.PollInterval = 50 * time.Millisecond
	}
	rl, err := relay.New(r.pool, w, rc)
	if err != nil {
		t.Fatal(err)
	}
	if err := rl.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_ = rl.Stop(c)
	})
	answers := o.answers
	if answers == nil {
		answers = map[string]sagatest.Answer{"svc.charge": sagatest.Reply("ok"), "svc.refund": sagatest.Reply("refunded")}
	}
	r.p = sagatest.NewParticipant(t, sagatest.ParticipantConfig{
		Brokers: r.kc.Addrs(), Topic: svcTopic, Pool: r.pool, Schema: r.schema, Answers: answers, Logger: discard,
	})
	cfg := o.cfg
	cfg.Schema = r.schema
	if cfg.Kafka == nil {
		cfg.Kafka = &saga.KafkaConfig{}
	}
	cfg.Kafka.Brokers = r.kc.Addrs()
	if o.mayRefuse {
		r.e, r.regErr = newEngine(t, r.pool, &cfg, def)
		return r
	}
	r.e = engine(t, r.pool, &cfg, def)
	return r
}

// engine builds, registers and starts an engine; it stops when the test
// ends.
func engine(t *testing.T, pool *pgxpool.Pool, cfg *saga.Config, defs ...saga.AnyDefinition) *saga.Engine {
	t.Helper()
	e, err := newEngine(t, pool, cfg, defs...)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// newEngine is engine, with New's or Register's error returned.
func newEngine(t *testing.T, pool *pgxpool.Pool, cfg *saga.Config, defs ...saga.AnyDefinition) (*saga.Engine, error) {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = discard
	}
	if cfg.Workers == 0 {
		cfg.Workers = 2
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 50 * time.Millisecond
	}
	e, err := saga.New(pool, cfg)
	if err != nil {
		return nil, fmt.Errorf("new engine: %w", err)
	}
	if err := e.Register(defs...); err != nil {
		return nil, fmt.Errorf("register: %w", err)
	}
	if err := e.Start(context.Background()); err != nil {
		t.Fatalf("start engine: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = e.Stop(ctx)
	})
	return e, nil
}

func (r *rig) start(t *testing.T, o order) uuid.UUID {
	t.Helper()
	st, err := saga.Start(ctxT(t, 10*time.Second), r.e, r.def, o, nil)
	if err != nil {
		t.Fatal(err)
	}
	return st.ID
}

// callsOf are the participant's calls for saga id, of type typ ("" for
// all).
func (r *rig) callsOf(id uuid.UUID, typ string) []sagatest.Call {
	var out []sagatest.Call
	for _, c := range r.p.Calls() {
		if c.Key.SagaID == id && (typ == "" || c.Type == typ) {
			out = append(out, c)
		}
	}
	return out
}

// get reads a saga.
func get(t testing.TB, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	in, err := e.Get(context.Background(), id)
	if err != nil {
		t.Fatalf("get: %v", err)
	}
	return in
}

// waitEnded is the reviewer's own wait, independent of the kit. It runs
// the rescuer now and then so that passed reply timeouts are noticed
// without waiting for RescueInterval.
func waitEnded(t testing.TB, e *saga.Engine, id uuid.UUID, d time.Duration) *saga.Instance {
	t.Helper()
	deadline := time.Now().Add(d)
	last := time.Now()
	for {
		in := get(t, e, id)
		if in.Status.Terminal() {
			return in
		}
		if time.Now().After(deadline) {
			t.Fatalf("saga %s has not ended after %v: %s at %s/%s\n%s", id, d, in.Status, in.Step, in.Direction, timeline(in))
		}
		if time.Since(last) > 500*time.Millisecond {
			_, _ = e.RescueNow(context.Background())
			last = time.Now()
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitFor polls cond every 20 ms until it holds or d passes.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func timeline(in *saga.Instance) string {
	var b strings.Builder
	for _, ev := range in.History {
		fmt.Fprintf(&b, "  %s %s/%s attempt=%d code=%s err=%.300q\n", ev.Type, ev.Step, ev.Direction, ev.Attempt, ev.ErrorCode, ev.Error)
	}
	return b.String()
}

// count is how many history entries of type typ ("step_completed", ...)
// saga in has for step/dir.
func count(in *saga.Instance, typ, step string) int {
	n := 0
	for _, ev := range in.History {
		if ev.Type == typ && ev.Step == step {
			n++
		}
	}
	return n
}

// ctxT is a context bounded by d, cancelled when the test ends.
func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// tally counts calls per saga id, safe for concurrent use.
type tally struct {
	mu sync.Mutex
	n  map[uuid.UUID]int
}

func newTally() *tally { return &tally{n: map[uuid.UUID]int{}} }

func (c *tally) add(id uuid.UUID) {
	c.mu.Lock()
	c.n[id]++
	c.mu.Unlock()
}

func (c *tally) of(id uuid.UUID) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[id]
}

// effects is a table in a schema of its own, where local steps record
// their effect in their transaction: a row per committed effect.
type effects struct {
	pool  *pgxpool.Pool
	table string
}

func newEffects(t *testing.T) *effects {
	t.Helper()
	pool, schema := pgtest.NewSchema(t)
	table := schema + ".effects"
	if _, err := pool.Exec(context.Background(), "CREATE TABLE "+table+" (saga uuid NOT NULL, step text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return &effects{pool: pool, table: table}
}

func (f *effects) record(ctx context.Context, run *saga.StepRun) error {
	_, err := run.Tx.Exec(ctx, "INSERT INTO "+f.table+" (saga, step) VALUES ($1, $2)", run.SagaID, run.Step+"/"+string(run.Direction))
	return err
}

func (f *effects) of(t *testing.T, id uuid.UUID, step string) int {
	t.Helper()
	var n int
	if err := f.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+f.table+" WHERE saga = $1 AND step = $2", id, step).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// chargeRemote is the usual remote step's Remote: the order as command,
// the reply's result kept in Got.
func chargeRemote(onReply func(ctx context.Context, run *saga.StepRun, o *order, res json.RawMessage) error) *saga.Remote[order] {
	if onReply == nil {
		onReply = func(_ context.Context, _ *saga.StepRun, o *order, res json.RawMessage) error {
			o.Got = string(res)
			return nil
		}
	}
	return &saga.Remote[order]{
		Topic: svcTopic, Type: "svc.charge", CompensateType: "svc.refund",
		Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil },
		OnReply: onReply,
	}
}
