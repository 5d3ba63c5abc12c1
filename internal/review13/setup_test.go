// Package review13 is a black-box review, written from the documentation
// only, of commits 19bf2f2 and 5b96f5b: in the hybrid mode a remote step
// after a local one has its Command run at once in the local step's
// transaction, and its command written with the local step's success in one
// fenced update of the saga's row. See FINDINGS.md.
package review13

import (
	"context"
	"errors"
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
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const wait = 25 * time.Second

// ord is the sagas' state.
type ord struct {
	ID   string `json:"id"`
	Note string `json:"note,omitempty"`
}

// payCmd is the remote command as the participant decodes it.
type payCmd struct {
	ID   string `json:"id"`
	Note string `json:"note,omitempty"`
}

// rig: an orchestrator schema with a relay, in the hybrid mode, and a real
// participant (its own schema and relay) serving name+".participant": it
// records every pay and refund it runs in its table "calls".
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

	payGate atomic.Pointer[testkit.Gate]
	refuse  atomic.Bool // pay is refused for good
}

// newRig builds the rig on a cluster of its own (kc nil) or a shared one.
func newRig(t *testing.T, name string, kc *kafkatest.Cluster) *rig {
	return newTenantRig(t, name, "", kc)
}

// newTenantRig is newRig for a tenant: when tenant is set, the engine's
// CommandTopic is tenant+".commands" and the participant's topic and
// consumer group are the tenant's, so that several tenants running the
// same saga type share one cluster.
func newTenantRig(t *testing.T, name, tenant string, kc *kafkatest.Cluster) *rig {
	t.Helper()
	h := testkit.NewHybrid(t, name, tenant, kc)
	r := &rig{name: name, tenant: tenant, topic: h.Topic, replies: h.Replies, kc: h.Cluster, orders: h.Orders, part: h.Part, h: h}
	r.fx = testkit.NewEffects(t, r.orders)
	p := h.Participant
	rec := func(ctx context.Context, tx pgx.Tx, kind string, c participant.Call[payCmd]) error {
		return h.Record(ctx, tx, c.SagaID, kind, c.Command.ID, len(c.Command.Note), c.Key.String())
	}
	require.NoError(t, participant.Handle(p, name+".pay", func(ctx context.Context, tx pgx.Tx, c participant.Call[payCmd]) (struct{}, error) {
		if g := r.payGate.Load(); g != nil {
			if err := g.Pass(ctx); err != nil {
				return struct{}{}, err
			}
		}
		if r.refuse.Load() {
			return struct{}{}, steps.Permanent(errors.New("refused"))
		}
		return struct{}{}, rec(ctx, tx, "pay", c)
	}))
	require.NoError(t, participant.Handle(p, name+".refund", func(ctx context.Context, tx pgx.Tx, c participant.Call[payCmd]) (struct{}, error) {
		return struct{}{}, rec(ctx, tx, "refund", c)
	}))
	h.Serve(t)
	t.Cleanup(func() {
		if g := r.payGate.Load(); g != nil {
			g.Open()
		}
	})
	return r
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

// remote is the pay step: a remote step to the rig's participant, its
// compensation a refund.
func (r *rig) remote(cmd func(ctx context.Context, run *saga.StepRun, o *ord) (any, error)) *saga.Remote[ord] {
	return &saga.Remote[ord]{Topic: r.topic, Type: r.name + ".pay", CompensateType: r.name + ".refund", Command: cmd}
}

// calls lists what the participant ran for saga id ("pay", "refund"), in order.
func (r *rig) calls(t *testing.T, id uuid.UUID) []string { return r.h.Calls(t, id) }

// sentTo counts the records on the participant's topic keyed by saga id.
func (r *rig) sentTo(t *testing.T, id uuid.UUID) int {
	t.Helper()
	msgs, err := r.kc.ReadAll(context.Background(), r.topic)
	require.NoError(t, err)
	n := 0
	for _, m := range msgs {
		if string(m.Key) == id.String() {
			n++
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
