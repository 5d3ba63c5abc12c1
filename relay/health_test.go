package relay_test

import (
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/health"
	"github.com/sagaflow/sagaflow/relay"
)

func reportChecks(r health.Report) map[string]bool {
	out := map[string]bool{}
	for _, c := range r.Checks {
		out[c.Name] = c.OK
	}
	return out
}

// The relay's Check is ready once it runs and listens, and not ready while
// the broker cannot take its writes; it stays live throughout.
func TestRelayCheck(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w := &outageWriter{errs: []error{io.ErrUnexpectedEOF}}
	r := e.relay(t, w, relay.Config{PollInterval: 20 * time.Millisecond, OutageBackoffMax: 50 * time.Millisecond})

	rep := r.Check(e.ctx)
	require.Equal(t, "relay", rep.Component)
	require.True(t, rep.Live)
	require.Equal(t, map[string]bool{"running": false, "broker": true, "outbox": true, "listen": false}, reportChecks(rep))

	require.NoError(t, r.Start(e.ctx))
	require.Eventually(t, func() bool { rep = r.Check(e.ctx); return rep.Ready }, 30*time.Second, 10*time.Millisecond, "%+v", rep)

	w.mu.Lock()
	w.down = true
	w.mu.Unlock()
	e.insert(t, topicOrders, "k", 1)
	require.Eventually(t, func() bool { rep = r.Check(e.ctx); return !reportChecks(rep)["broker"] }, 30*time.Second, 10*time.Millisecond, "%+v", rep)
	require.False(t, rep.Ready)
	require.True(t, rep.Live)
	require.Contains(t, rep.Checks[2].Detail, "1 pending")
}
