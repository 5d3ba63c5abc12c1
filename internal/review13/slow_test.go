package review13

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// A Command that runs past its step's Timeout and honours its context (it
// returns ctx.Err()): the failure is pay's (retried, the command built
// again and sent once), never pick's: pick runs once and its effect is kept
// once. Nothing is lost or stuck.
//
// F3 (fixed after the review): the Command's ctx had no deadline at all, so
// it was never cancelled and ran until its own 3 s fallback. It is now
// bounded by pay's Timeout (1 s here; the review expected pick's).
func TestSlowCommandAfterALocalStep(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name string }{{"slowctx"}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r := newRig(t, c.name, nil)
			var picks, builds counter
			def := saga.Define(c.name,
				saga.Step[ord]{Name: "pick", Timeout: 300 * time.Millisecond, Retry: noBackoff(3),
					Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
						picks.Add(o.ID)
						return r.fx.Record(ctx, run, "pick")
					},
					Compensate: func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "unpick") }},
				saga.Step[ord]{Name: "pay", Timeout: time.Second, Retry: noBackoff(3), Remote: r.remote(
					func(ctx context.Context, run *saga.StepRun, o *ord) (any, error) {
						if builds.Add(o.ID) == 1 {
							select {
							case <-ctx.Done():
								return nil, ctx.Err()
							case <-time.After(3 * time.Second):
								return nil, errors.New("the step's context was never cancelled")
							}
						}
						return payCmd{ID: o.ID}, nil
					})},
			)
			r.start(t, func(cfg *saga.Config) { cfg.HandlerGrace = 200 * time.Millisecond }, def)
			st, err := saga.Start(context.Background(), r.engine, def, ord{ID: "o-1"}, nil)
			require.NoError(t, err)
			in := r.ended(t, st.ID)
			require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", types(in), in.LastError)
			require.Equal(t, int32(1), picks.Get("o-1"), "pick ran once: %v", types(in))
			require.Equal(t, int32(2), builds.Get("o-1"), "%v", types(in))
			require.Equal(t, []string{"pick"}, r.fx.List(t, st.ID))
			require.Equal(t, []string{"pay"}, r.calls(t, st.ID))
			require.NotContains(t, types(in), "step_failed:pick", "%v", types(in))
			require.Contains(t, types(in), "step_failed:pay", "%v", types(in))
			for _, e := range in.History {
				if e.Type == "step_failed" {
					require.NotContains(t, e.Error, "never cancelled", "pay's Command was bounded by pay's Timeout")
				}
			}
		})
	}
}

// pay's Command fails retryably right after pick with PauseWhenExhausted:
// the saga pauses at pay with nothing sent; Resume builds the command again
// (pick is not repeated), sends it once, and the saga completes.
func TestResumeRebuildsTheCommandNotTheLocalStep(t *testing.T) {
	t.Parallel()
	r := newRig(t, "resume", nil)
	var picks, builds counter
	var down atomic.Bool
	down.Store(true)
	def := saga.Define("resume",
		saga.Step[ord]{Name: "pick", Retry: noBackoff(1),
			Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
				picks.Add(o.ID)
				return r.fx.Record(ctx, run, "pick")
			}},
		saga.Step[ord]{Name: "pay", Timeout: wait, Retry: noBackoff(2), PauseWhenExhausted: true, Remote: r.remote(
			func(ctx context.Context, run *saga.StepRun, o *ord) (any, error) {
				builds.Add(o.ID)
				if _, err := run.Tx.Exec(ctx, "SELECT 1"); err != nil {
					return nil, err
				}
				if down.Load() {
					return nil, errors.New("card vault unavailable")
				}
				return payCmd{ID: o.ID}, nil
			})},
	)
	r.start(t, nil, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, r.engine, def, ord{ID: "o-1"}, nil)
	require.NoError(t, err)
	in := sagatest.Wait(t, r.engine, st.ID, sagatest.Cond("paused", func(in *saga.Instance) bool { return in.Paused != nil }),
		&sagatest.WaitOpts{Timeout: wait})
	require.Equal(t, "pay", in.Step, "%v", types(in))
	require.Equal(t, int32(2), builds.Get("o-1"))
	require.Zero(t, r.sentTo(t, st.ID))
	require.NotNil(t, in.LastError)
	require.Contains(t, in.LastError.Message, "card vault unavailable")

	down.Store(false)
	require.NoError(t, r.engine.Resume(ctx, st.ID, "vault is back"))
	in = r.ended(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", types(in), in.LastError)
	require.Equal(t, int32(1), picks.Get("o-1"), "pick ran once")
	require.Equal(t, int32(3), builds.Get("o-1"))
	require.Equal(t, []string{"pick"}, r.fx.List(t, st.ID))
	require.Equal(t, []string{"pay"}, r.calls(t, st.ID))
	require.Equal(t, 1, r.sentTo(t, st.ID))
}
