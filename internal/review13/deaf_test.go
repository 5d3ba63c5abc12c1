package review13

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// deafDef: pick (Timeout 300 ms) then pay (Timeout payTimeout), with
// HandlerGrace 200 ms; the first run of pick's Action (deafAction) or of
// pay's Command (otherwise) sleeps 3 s ignoring its context. The sleeper is
// waited for at cleanup.
func deafRun(t *testing.T, name string, deafAction bool, payTimeout time.Duration) (*rig, *saga.Instance, *counter, *counter) {
	t.Helper()
	r := newRig(t, name, nil)
	var picks, builds counter
	var sleepers sync.WaitGroup
	sleepers.Add(1) // the one deaf run
	t.Cleanup(sleepers.Wait)
	deaf := func() {
		defer sleepers.Done()
		time.Sleep(3 * time.Second)
	}
	def := saga.Define(name,
		saga.Step[ord]{Name: "pick", Timeout: 300 * time.Millisecond, Retry: noBackoff(3),
			Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
				if picks.Add(o.ID) == 1 && deafAction {
					deaf()
				}
				return r.fx.Record(context.WithoutCancel(ctx), run, "pick")
			}},
		saga.Step[ord]{Name: "pay", Timeout: payTimeout, Retry: noBackoff(3), Remote: r.remote(
			func(_ context.Context, _ *saga.StepRun, o *ord) (any, error) {
				if builds.Add(o.ID) == 1 && !deafAction {
					deaf()
				}
				return payCmd{ID: o.ID}, nil
			})},
	)
	r.start(t, func(cfg *saga.Config) { cfg.HandlerGrace = 200 * time.Millisecond }, def)
	st, err := saga.Start(context.Background(), r.engine, def, ord{ID: "o-1"}, nil)
	require.NoError(t, err)
	in := r.ended(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", types(in), in.LastError)
	return r, in, &picks, &builds
}

func overran(in *saga.Instance) string {
	for _, e := range in.History {
		if e.ErrorCode == saga.CodeAbandonedRunOn {
			return e.Step
		}
	}
	return ""
}

// Control: a local Action that ignores its context past Timeout +
// HandlerGrace is abandoned (handler_overran) and retried; its effect
// is kept once.
func TestDeafActionIsAbandoned(t *testing.T) {
	t.Parallel()
	r, in, _, _ := deafRun(t, "deafact", true, wait)
	require.Equal(t, int64(1), r.engine.Stats().HandlersAbandoned, "%v", types(in))
	require.Equal(t, "pick", overran(in), "%v", types(in))
	require.Equal(t, []string{"pick"}, r.fx.List(t, in.ID))
	require.Equal(t, []string{"pay"}, r.calls(t, in.ID))
}

// F3 (fixed after the review, differently from what it expected). The same
// deafness in pay's Command, which runs in pick's transaction: the Command
// runs as a handler, bounded by pay's Timeout (1 s here), and is abandoned
// after Timeout + HandlerGrace. Its worker gives the connection up, and
// pick's success goes with the transaction: the attempt is recorded as
// pick's (handler_overran), pick runs again (its first effect was never
// committed), and the saga completes with one effect and one charge.
// (The review expected pick's Timeout to bound the Command and pick's
// success to be kept: the doc said "ctx is that step's", which it no
// longer says.)
func TestDeafCommandAfterALocalStepIsAbandoned(t *testing.T) {
	t.Parallel()
	r, in, picks, builds := deafRun(t, "deafcmd", false, time.Second)
	require.Equal(t, int32(2), picks.Get("o-1"), "pick ran again, its first success lost with the transaction: %v", types(in))
	require.Equal(t, []string{"pick"}, r.fx.List(t, in.ID))
	require.Equal(t, []string{"pay"}, r.calls(t, in.ID))
	require.Equal(t, int64(1), r.engine.Stats().HandlersAbandoned, "the deaf Command was abandoned: %v", types(in))
	require.Equal(t, "pick", overran(in), "%v", types(in))
	require.Equal(t, int32(2), builds.Get("o-1"))
}
