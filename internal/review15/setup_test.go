// Package review15 is a black-box review, written from the documentation
// only, of commits cfc7962 and 90579db: in the hybrid mode a reply whose
// next step is another remote step runs that step's Command in the reply's
// transaction and writes the reply and the next command in one update of
// the saga's row. See FINDINGS.md.
package review15

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const wait = 25 * time.Second

// ord is the sagas' state. Paid is set by pay's OnReply.
type ord struct {
	ID   string `json:"id"`
	Note string `json:"note,omitempty"`
	Paid string `json:"paid,omitempty"`
}

// cmd is a remote command as the participant decodes it.
type cmd struct {
	ID   string `json:"id"`
	Note string `json:"note,omitempty"`
}

// rig: an orchestrator schema with a relay, in the hybrid mode, and a real
// participant (its own schema and relay) serving name+".participant": it
// records every pay, refund, bill and unbill it runs in its table "calls".
type rig struct {
	name    string
	tenant  string
	kc      *kafkatest.Cluster
	orders  *testkit.DB
	part    *testkit.DB
	fx      *testkit.Effects
	engine  *saga.Engine
	topic   string // the participant's command topic
	replies string
	h       *testkit.Hybrid

	// per-test hooks (nil: default behaviour)
	onPayReply func(ctx context.Context, run *saga.StepRun, o *ord) error
	billCmd    func(ctx context.Context, run *saga.StepRun, o *ord) (any, error)
	billGate   atomic.Pointer[testkit.Gate] // holds the participant's bill
	payGate    atomic.Pointer[testkit.Gate] // holds the participant's pay
	billTime   time.Duration                // bill's Timeout (wait when 0)
}

func newRig(t *testing.T, name string, kc *kafkatest.Cluster) *rig {
	return newTenantRig(t, name, "", kc)
}

// newTenantRig is newRig for a tenant (its own CommandTopic, participant
// topic and consumer group), so that tenants can share one cluster.
func newTenantRig(t *testing.T, name, tenant string, kc *kafkatest.Cluster) *rig {
	t.Helper()
	h := testkit.NewHybrid(t, name, tenant, kc)
	r := &rig{name: name, tenant: tenant, topic: h.Topic, replies: h.Replies, kc: h.Cluster, orders: h.Orders, part: h.Part, h: h}
	r.fx = testkit.NewEffects(t, r.orders)
	p := h.Participant
	for _, kind := range []string{"pay", "refund", "bill", "unbill"} {
		require.NoError(t, participant.Handle(p, name+"."+kind, func(ctx context.Context, tx pgx.Tx, c participant.Call[cmd]) (map[string]string, error) {
			if g := r.payGate.Load(); g != nil && kind == "pay" {
				if err := g.Pass(ctx); err != nil {
					return nil, err
				}
			}
			if kind == "bill" {
				if g := r.billGate.Load(); g != nil {
					if err := g.Pass(ctx); err != nil {
						return nil, err
					}
				}
				if strings.HasPrefix(c.Command.ID, "refusebill") {
					return nil, steps.Permanent(errors.New("bill refused"))
				}
			}
			err := h.Record(ctx, tx, c.SagaID, kind, c.Command.ID, len(c.Command.Note), c.Key.String())
			return map[string]string{"ref": kind + "-" + c.Command.ID}, err
		}))
	}
	h.Serve(t)
	t.Cleanup(func() {
		if g := r.billGate.Load(); g != nil {
			g.Open()
		}
		if g := r.payGate.Load(); g != nil {
			g.Open()
		}
	})
	return r
}

// def: pick (local) -> pay (remote, OnReply records "paid" and sets
// o.Paid) -> bill (remote) -> ship (local).
func (r *rig) def(retry int) *saga.Definition[ord] {
	pay := &saga.Remote[ord]{Topic: r.topic, Type: r.name + ".pay", CompensateType: r.name + ".refund",
		Command: func(_ context.Context, _ *saga.StepRun, o *ord) (any, error) { return cmd{ID: o.ID}, nil },
		OnReply: func(ctx context.Context, run *saga.StepRun, o *ord, res json.RawMessage) error {
			var v map[string]string
			if err := json.Unmarshal(res, &v); err != nil {
				return err
			}
			o.Paid = v["ref"]
			if err := r.fx.Record(ctx, run, "paid"); err != nil {
				return err
			}
			if r.onPayReply != nil {
				return r.onPayReply(ctx, run, o)
			}
			return nil
		}}
	bill := &saga.Remote[ord]{Topic: r.topic, Type: r.name + ".bill", CompensateType: r.name + ".unbill",
		Command: func(ctx context.Context, run *saga.StepRun, o *ord) (any, error) {
			if r.billCmd != nil {
				return r.billCmd(ctx, run, o)
			}
			return cmd{ID: o.ID, Note: o.Paid}, nil
		}}
	billTime := r.billTime
	if billTime == 0 {
		billTime = wait
	}
	return saga.Define(r.name,
		saga.Step[ord]{Name: "pick", Retry: noBackoff(1),
			Action:     func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "pick") },
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "unpick") }},
		saga.Step[ord]{Name: "pay", Timeout: wait, Remote: pay},
		saga.Step[ord]{Name: "bill", Timeout: billTime, Retry: noBackoff(retry), Remote: bill},
		saga.Step[ord]{Name: "ship", Action: func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "ship") }},
	)
}

// start registers defs on a new hybrid engine and starts it.
func (r *rig) start(t *testing.T, mod func(*saga.Config), defs ...saga.AnyDefinition) {
	t.Helper()
	cfg := r.h.Config()
	if mod != nil {
		mod(cfg)
	}
	r.engine, _ = testkit.StartEngine(t, r.orders.Pool, cfg, defs...)
}

// calls lists the kinds the participant ran for saga id, in order.
func (r *rig) calls(t *testing.T, id uuid.UUID) []string { return r.h.Calls(t, id) }

// sent counts the records of the given type on the participant's topic
// keyed by saga id ("" for any type).
func (r *rig) sent(t *testing.T, id uuid.UUID, kind string) int {
	t.Helper()
	msgs, err := r.kc.ReadAll(context.Background(), r.topic)
	require.NoError(t, err)
	n := 0
	for _, m := range msgs {
		if string(m.Key) != id.String() {
			continue
		}
		if kind == "" {
			n++
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

func (r *rig) stepKey(t *testing.T, id uuid.UUID, kind string) string {
	t.Helper()
	var k string
	require.NoError(t, r.part.Pool.QueryRow(context.Background(), "SELECT step_key FROM "+r.part.Table("calls")+
		" WHERE saga_id = $1 AND kind = $2", id, kind).Scan(&k))
	return k
}

func types(in *saga.Instance) []string {
	out := make([]string, 0, len(in.History))
	for _, e := range in.History {
		s := e.Type
		if e.Step != "" {
			s += ":" + e.Step
		}
		out = append(out, s)
	}
	return out
}

func noBackoff(n int) *saga.RetryPolicy {
	return &saga.RetryPolicy{MaxAttempts: n, Backoff: func(int) time.Duration { return 10 * time.Millisecond }}
}

// counter counts calls per key (see testkit.Counter).
type counter = testkit.Counter

// awaitCancel gives the engine up to a second to cancel ctx, then returns.
func awaitCancel(ctx context.Context) {
	select {
	case <-ctx.Done():
	case <-time.After(time.Second):
	}
}

// timeline is types with each failure's attempt and code.
func timeline(in *saga.Instance) []string {
	out := make([]string, 0, len(in.History))
	for _, e := range in.History {
		s := e.Type + ":" + e.Step
		if e.ErrorCode != "" {
			s += fmt.Sprintf("#%d(%s)", e.Attempt, e.ErrorCode)
		}
		out = append(out, s)
	}
	return out
}

// waitNoPending waits for d's outbox to hold no pending row.
func waitNoPending(t *testing.T, d *testkit.DB) {
	t.Helper()
	testkit.WaitFor(t, wait, d.Schema+": no pending outbox row", func() bool {
		return d.Count(t, "SELECT count(*) FROM "+d.Table("outbox")+" WHERE status = 'pending'") == 0
	})
}
