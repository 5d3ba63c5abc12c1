package review13

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// deafDef: pick (Timeout 300 ms) then pay, with HandlerGrace 200 ms; the
// first run of pick's Action (deafAction) or of pay's Command (otherwise)
// sleeps 1.5 s ignoring its context. The sleeper is waited for at cleanup.
func deafRun(t *testing.T, name string, deafAction bool) (*rig, *saga.Instance, *counter, *counter) {
	t.Helper()
	r := newRig(t, name, nil)
	var picks, builds counter
	var sleepers sync.WaitGroup
	sleepers.Add(1) // the one deaf run
	t.Cleanup(sleepers.Wait)
	deaf := func() {
		defer sleepers.Done()
		time.Sleep(1500 * time.Millisecond)
	}
	def := saga.Define(name,
		saga.Step[ord]{Name: "pick", Timeout: 300 * time.Millisecond, Retry: noBackoff(3),
			Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
				if picks.add(o.ID) == 1 && deafAction {
					deaf()
				}
				return r.fx.Record(context.WithoutCancel(ctx), run, "pick")
			}},
		saga.Step[ord]{Name: "pay", Timeout: wait, Retry: noBackoff(3), Remote: r.remote(
			func(_ context.Context, _ *saga.StepRun, o *ord) (any, error) {
				if builds.add(o.ID) == 1 && !deafAction {
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
	r, in, _, _ := deafRun(t, "deafact", true)
	require.Equal(t, int64(1), r.engine.Stats().HandlersAbandoned, "%v", types(in))
	require.Equal(t, "pick", overran(in), "%v", types(in))
	require.Equal(t, []string{"pick"}, r.fx.List(t, in.ID))
	require.Equal(t, []string{"pay"}, r.calls(t, in.ID))
}

// FINDING F3. The same deafness in pay's Command, which now runs inside
// pick's attempt (ctx is pick's, Timeout 300 ms), is not abandoned: the
// worker waits the full 1.5 s (past Timeout + HandlerGrace) and then sends
// what the late Command returned, as if nothing happened. A Command that
// hangs (a network call without the context) holds its worker, and the
// batch's other sagas, for as long as it hangs: HandlerGrace, which bounds
// every handler, does not bound it.
func TestDeafCommandAfterALocalStepIsAbandoned(t *testing.T) {
	t.Skip("FINDING F3 (open): a Command chained after a local step that ignores its context is not abandoned after Timeout + HandlerGrace; see FINDINGS.md")
	t.Parallel()
	r, in, picks, builds := deafRun(t, "deafcmd", false)
	require.Equal(t, int32(1), picks.get("o-1"), "pick ran once: %v", types(in))
	require.Equal(t, []string{"pick"}, r.fx.List(t, in.ID))
	require.Equal(t, []string{"pay"}, r.calls(t, in.ID))
	require.Equal(t, int64(1), r.engine.Stats().HandlersAbandoned, "the deaf Command was abandoned: %v", types(in))
	require.Equal(t, "pay", overran(in), "%v", types(in))
	require.Equal(t, int32(2), builds.get("o-1"))
}
