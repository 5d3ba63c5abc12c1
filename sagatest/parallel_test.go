package sagatest_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

type prepared struct {
	OrderID string `json:"order_id"`
	Stock   string `json:"stock,omitempty"`
	Auth    string `json:"auth,omitempty"`
}

// compensations records the branches' compensations, with their results.
type compensations struct {
	mu  sync.Mutex
	got map[string]string
}

func (c *compensations) add(branch string, result json.RawMessage) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.got == nil {
		c.got = map[string]string{}
	}
	c.got[branch] = string(result)
}

func (c *compensations) all() map[string]string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string]string{}
	for k, v := range c.got {
		out[k] = v
	}
	return out
}

// remoteParallel is a parallel step "prepare": a local branch stock and a
// remote branch card to the payment service, joined into the state.
func remoteParallel(name string, comp *compensations, timeout time.Duration) *saga.Definition[prepared] {
	return saga.Define(name, saga.Step[prepared]{Name: "prepare", Parallel: &saga.Parallel[prepared]{
		Branches: []saga.Branch[prepared]{
			{Name: "stock",
				Action: func(_ context.Context, _ *saga.StepRun, p prepared) (any, error) { return "res-" + p.OrderID, nil },
				Compensate: func(_ context.Context, _ *saga.StepRun, _ prepared, r json.RawMessage) error {
					comp.add("stock", r)
					return nil
				}},
			{Name: "card", Timeout: timeout,
				Remote: &saga.RemoteBranch[prepared]{Topic: "payments.commands", Type: "payments.authorize",
					Command: func(_ context.Context, _ *saga.StepRun, p prepared) (any, error) { return p, nil }},
				Compensate: func(_ context.Context, _ *saga.StepRun, _ prepared, r json.RawMessage) error {
					comp.add("card", r)
					return nil
				}},
		},
		Join: func(_ context.Context, _ *saga.StepRun, p *prepared, results map[string]json.RawMessage) error {
			if err := json.Unmarshal(results["stock"], &p.Stock); err != nil {
				return err
			}
			var auth struct {
				Code string `json:"code"`
			}
			if err := json.Unmarshal(results["card"], &auth); err != nil {
				return err
			}
			p.Auth = auth.Code
			return nil
		}}})
}

// A parallel step with a remote branch: the participant's reply completes
// the branch and its result reaches the join; a refusal, or no reply within
// the branch's Timeout, fails the group, which compensates the local branch
// (and the silent remote one, with a null result).
func TestRemoteBranches(t *testing.T) {
	t.Parallel()
	b := setup(t, saga.CommandTopicDefault+".rpar.replies", "payments.commands")
	pool, schema := migrated(t)
	payments := sagatest.NewParticipant(t, sagatest.ParticipantConfig{Brokers: b.kc.Addrs(), Topic: "payments.commands",
		Pool: pool, Schema: schema, Answers: map[string]sagatest.Answer{"payments.authorize": sagatest.Reply(map[string]string{"code": "A1"})}})
	var comp compensations
	def := remoteParallel("rpar", &comp, 2*time.Second)
	b.start(t, def)
	ctx := context.Background()

	st, err := saga.Start(ctx, b.engine, def, prepared{OrderID: "o1"}, nil)
	require.NoError(t, err)
	in := sagatest.WaitEnded(t, b.engine, st.ID, nil)
	require.Equal(t, saga.StatusCompleted, in.Status, "timeline: %v", sagatest.Timeline(in))
	var got prepared
	require.NoError(t, in.DecodeState(&got))
	require.Equal(t, prepared{OrderID: "o1", Stock: "res-o1", Auth: "A1"}, got)
	calls := payments.Calls()
	require.Len(t, calls, 1)
	require.Equal(t, steps.Key{SagaID: st.ID, Step: "prepare.card", Direction: steps.Forward}, calls[0].Key)
	require.Empty(t, comp.all())

	// The refusal comes once the local branch has completed, so that there
	// is a completed branch to compensate (under load the reply could
	// otherwise come first, and the local branch be cancelled instead: a CI
	// run saw nothing compensated).
	payments.Answer("payments.authorize", sagatest.AnswerFunc(func(ctx context.Context, c sagatest.Call) (any, error) {
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			var done bool
			err := b.pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM "+b.table("saga_branches")+
				" WHERE saga_id = $1 AND branch = 'stock' AND status = 'completed')", c.Key.SagaID).Scan(&done)
			if err != nil || done {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		return nil, steps.Permanent(steps.WithCode("card_declined", errors.New("the card was declined")))
	}))
	st, err = saga.Start(ctx, b.engine, def, prepared{OrderID: "o2"}, nil)
	require.NoError(t, err)
	in = sagatest.WaitEnded(t, b.engine, st.ID, nil)
	require.Equal(t, saga.StatusCompensated, in.Status, "timeline: %v", sagatest.Timeline(in))
	require.Equal(t, "card_declined", in.LastError.Code)
	require.Equal(t, map[string]string{"stock": `"res-o2"`}, comp.all(), "only the completed branch is compensated")

	payments.Answer("payments.authorize", sagatest.NoReply())
	comp = compensations{}
	st, err = saga.Start(ctx, b.engine, def, prepared{OrderID: "o3"}, nil)
	require.NoError(t, err)
	in = sagatest.WaitEnded(t, b.engine, st.ID, nil)
	require.Equal(t, saga.StatusCompensated, in.Status, "timeline: %v", sagatest.Timeline(in))
	require.Equal(t, saga.CodeReplyTimeout, in.LastError.Code)
	require.Equal(t, map[string]string{"stock": `"res-o3"`, "card": "null"}, comp.all(),
		"the silent participant may have acted: its branch is compensated too")

	// A remote branch's command over Config.MaxCommandBytes (a state just
	// under MaxStateBytes, sent whole) fails the group at once, coded, and
	// reaches no participant: the relay would park it, and the saga would
	// wait the branch's Timeout for a reply that cannot come (review35 F1).
	big := strings.Repeat("x", saga.MaxStateBytesDefault-8<<10)
	st, err = saga.Start(ctx, b.engine, def, prepared{OrderID: big}, nil)
	require.NoError(t, err)
	in = sagatest.WaitEnded(t, b.engine, st.ID, nil)
	require.Equal(t, saga.StatusCompensated, in.Status, "timeline: %v", sagatest.Timeline(in))
	require.Equal(t, saga.CodeTooLarge, in.LastError.Code, "%+v", in.LastError)
	require.Contains(t, in.LastError.Message, "MaxCommandBytes")
	for _, c := range payments.Calls() {
		require.NotEqual(t, st.ID, c.Key.SagaID, "the oversized command reached the participant")
	}
}
