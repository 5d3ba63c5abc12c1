// Package review16 is a black-box review, written from the documentation
// only, of commits 0c4ef86 and 7573c6b: KafkaConfig.ReplyStepLimit (a step
// run at once after a reply on the Kafka reply worker is given up past the
// limit and handed to an engine worker) and an abandoned attempt recorded
// before any worker of the same engine runs its step again. See
// FINDINGS.md.
package review16

import (
	"context"
	"encoding/json"
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
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/wire"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const wait = 30 * time.Second

// ord is the sagas' state; Paid is set by pay's OnReply.
type ord struct {
	ID   string `json:"id"`
	Paid string `json:"paid,omitempty"`
}

type cmd struct {
	ID   string `json:"id"`
	Note string `json:"note,omitempty"`
}

// rig: an orchestrator schema in the hybrid mode and a participant serving
// pay/refund/bill/unbill, recording what it ran in its table "calls". The
// saga (def) is
//
//	pick (local) -> pay (remote; OnReply records "paid")
//	  [-> bill (remote, Command hook)]   with opts.bill
//	  -> ship (local, hook; compensation "unship")
//	  [-> await (OnSignal "go", records "go")]   with opts.await
//	  -> done (local)
//
// so that ship (or bill's Command) is the step run at once after a reply.
type rig struct {
	name   string
	h      *testkit.Hybrid
	kc     *kafkatest.Cluster
	orders *testkit.DB
	part   *testkit.DB
	fx     *testkit.Effects
	engine *saga.Engine

	ship      func(ctx context.Context, run *saga.StepRun, o *ord, n int32) error // n: run number for o
	billCmd   func(ctx context.Context, run *saga.StepRun, o *ord, n int32) (any, error)
	payResult func(c cmd) map[string]string

	shipRuns counter
	billRuns counter
	payGate  atomic.Pointer[testkit.Gate]
	sleepers testkit.Stragglers
}

type defOpts struct {
	bill        bool
	await       bool
	shipRetry   int
	shipTimeout time.Duration
	payTimeout  time.Duration
}

func newRig(t *testing.T, name, tenant string, kc *kafkatest.Cluster) *rig {
	t.Helper()
	h := testkit.NewHybrid(t, name, tenant, kc)
	r := &rig{name: name, h: h, kc: h.Cluster, orders: h.Orders, part: h.Part}
	r.fx = testkit.NewEffects(t, r.orders)
	for _, kind := range []string{"pay", "refund", "bill", "unbill"} {
		require.NoError(t, participant.Handle(h.Participant, name+"."+kind, func(ctx context.Context, tx pgx.Tx, c participant.Call[cmd]) (map[string]string, error) {
			if g := r.payGate.Load(); g != nil && kind == "pay" {
				if err := g.Pass(ctx); err != nil {
					return nil, err
				}
			}
			if err := h.Record(ctx, tx, c.SagaID, kind, c.Command.ID, len(c.Command.Note), c.Key.String()); err != nil {
				return nil, err
			}
			if kind == "pay" && r.payResult != nil {
				return r.payResult(c.Command), nil
			}
			return map[string]string{"ref": kind + "-" + c.Command.ID}, nil
		}))
	}
	h.Serve(t)
	t.Cleanup(func() {
		if g := r.payGate.Load(); g != nil {
			g.Open()
		}
	})
	// registered after the engine's cleanup (Start below), so it runs
	// before: wait for deaf handlers still sleeping
	return r
}

func (r *rig) def(o defOpts) *saga.Definition[ord] {
	if o.shipRetry == 0 {
		o.shipRetry = 3
	}
	if o.shipTimeout == 0 {
		o.shipTimeout = 10 * time.Second
	}
	if o.payTimeout == 0 {
		o.payTimeout = wait
	}
	topic := r.h.Topic
	pay := &saga.Remote[ord]{Topic: topic, Type: r.name + ".pay", CompensateType: r.name + ".refund",
		Command: func(_ context.Context, _ *saga.StepRun, s *ord) (any, error) { return cmd{ID: s.ID}, nil },
		OnReply: func(ctx context.Context, run *saga.StepRun, s *ord, res json.RawMessage) error {
			var v map[string]string
			if err := json.Unmarshal(res, &v); err != nil {
				return err
			}
			s.Paid = v["ref"]
			return r.fx.Record(ctx, run, "paid")
		}}
	list := []saga.Step[ord]{
		{Name: "pick", Retry: noBackoff(1),
			Action:     func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "pick") },
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "unpick") }},
		{Name: "pay", Timeout: o.payTimeout, Remote: pay},
	}
	if o.bill {
		list = append(list, saga.Step[ord]{Name: "bill", Timeout: wait, Retry: noBackoff(3), Remote: &saga.Remote[ord]{
			Topic: topic, Type: r.name + ".bill", CompensateType: r.name + ".unbill",
			Command: func(ctx context.Context, run *saga.StepRun, s *ord) (any, error) {
				n := r.billRuns.Add(s.ID)
				if r.billCmd != nil {
					return r.billCmd(ctx, run, s, n)
				}
				return cmd{ID: s.ID, Note: s.Paid}, nil
			}}})
	}
	list = append(list, saga.Step[ord]{Name: "ship", Timeout: o.shipTimeout, Retry: noBackoff(o.shipRetry),
		Action: func(ctx context.Context, run *saga.StepRun, s *ord) error {
			n := r.shipRuns.Add(s.ID)
			if r.ship != nil {
				return r.ship(ctx, run, s, n)
			}
			return r.fx.Record(ctx, run, "ship")
		},
		Compensate: func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "unship") }})
	if o.await {
		list = append(list, saga.Step[ord]{Name: "await", Wait: saga.OnSignal("go",
			func(ctx context.Context, run *saga.StepRun, _ *ord, _ json.RawMessage) error {
				return r.fx.Record(ctx, run, "go")
			})})
	}
	list = append(list, saga.Step[ord]{Name: "done",
		Action: func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "done") }})
	return saga.Define(r.name, list...)
}

// start registers defs on a new hybrid engine (2 workers) and starts it.
func (r *rig) start(t *testing.T, mod func(*saga.Config), defs ...saga.AnyDefinition) {
	t.Helper()
	cfg := r.h.Config()
	if mod != nil {
		mod(cfg)
	}
	r.engine, _ = testkit.StartEngine(t, r.orders.Pool, cfg, defs...)
	// Cleanups run last-in first-out: this one runs before the engine
	// stops, so that deaf handlers still sleeping have returned.
	t.Cleanup(r.sleepers.Wait)
}

// sleep sleeps d ignoring every context, counted in r.sleepers.
func (r *rig) sleep(d time.Duration) {
	defer r.sleepers.Enter()()
	time.Sleep(d)
}

func (r *rig) ended(t *testing.T, id uuid.UUID) *saga.Instance {
	t.Helper()
	return sagatest.WaitEnded(t, r.engine, id, &sagatest.WaitOpts{Timeout: wait})
}

func (r *rig) get(t *testing.T, id uuid.UUID) *saga.Instance {
	t.Helper()
	in, err := r.engine.Get(context.Background(), id)
	require.NoError(t, err)
	return in
}

func (r *rig) calls(t *testing.T, id uuid.UUID) []string { return r.h.Calls(t, id) }

// sent counts the records of kind on the participant's topic keyed by id.
func (r *rig) sent(t *testing.T, id uuid.UUID, kind string) int {
	t.Helper()
	msgs, err := r.kc.ReadAll(context.Background(), r.h.Topic)
	require.NoError(t, err)
	n := 0
	for _, m := range msgs {
		if string(m.Key) != id.String() {
			continue
		}
		for _, h := range m.Headers {
			if h.Key == wire.HeaderType && string(h.Value) == r.name+"."+kind {
				n++
			}
		}
	}
	return n
}

func (r *rig) deadLetters(t *testing.T) int {
	return r.orders.Count(t, "SELECT count(*) FROM "+r.orders.Table("dead_letters"))
}

func (r *rig) stepKey(t *testing.T, id uuid.UUID, kind string) string {
	t.Helper()
	var k string
	require.NoError(t, r.part.Pool.QueryRow(context.Background(), "SELECT step_key FROM "+r.part.Table("calls")+
		" WHERE saga_id = $1 AND kind = $2", id, kind).Scan(&k))
	return k
}

// readerPool is a pool of its own on d's database, so that a handler's
// look at the history does not wait for a connection of the engine's pool.
func readerPool(t *testing.T, d *testkit.DB) *testkit.DB {
	t.Helper()
	cfg := d.Pool.Config().Copy()
	cfg.MaxConns = 16
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return &testkit.DB{Pool: p, Schema: d.Schema}
}

// historyCount counts saga id's history entries of type typ for step,
// read straight from the table, from outside the engine.
func historyCount(ctx context.Context, d *testkit.DB, id uuid.UUID, typ, step string) (int, error) {
	var n int
	err := d.Pool.QueryRow(ctx, "SELECT count(*) FROM "+d.Table("saga_history")+
		" WHERE saga_id = $1 AND event = $2 AND step_name = $3", id, typ, step).Scan(&n)
	return n, err
}

func noBackoff(n int) *saga.RetryPolicy {
	return &saga.RetryPolicy{MaxAttempts: n, Backoff: func(int) time.Duration { return 5 * time.Millisecond }}
}

// timeline and count read a saga's history (see testkit.Timeline and
// testkit.Events).
var (
	timeline = testkit.Timeline
	count    = testkit.Events
)

// failedAttempts lists the attempts of step's step_failed entries, in order.
func failedAttempts(in *saga.Instance, step string) []int {
	var out []int
	for _, e := range in.History {
		if e.Type == "step_failed" && e.Step == step {
			out = append(out, e.Attempt)
		}
	}
	return out
}

// counter counts calls per key (see testkit.Counter).
type counter = testkit.Counter

// waitCtx waits for ctx to end or d to pass and reports whether ctx ended.
func waitCtx(ctx context.Context, d time.Duration) bool {
	select {
	case <-ctx.Done():
		return true
	case <-time.After(d):
		return false
	}
}
