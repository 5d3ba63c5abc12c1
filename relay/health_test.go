package relay_test

import (
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/health"
	"github.com/sagaflow/sagaflow/internal/pgtest"
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

// Right after a database restart the pool still holds connections the
// restart broke, used too recently to be pinged: Health and Check read the
// outbox again on the next connection instead of reporting the broken one
// (review22 saw Health fail so after a crash).
func TestHealthAfterTheDatabaseBrokeThePoolsConnections(t *testing.T) {
	t.Parallel()
	e := setup(t)
	pool := pgtest.RecentPool(t, 3)
	r, err := relay.New(pool, &outageWriter{}, &relay.Config{Schema: e.schema, Logger: quiet})
	require.NoError(t, err)
	e.insert(t, topicOrders, "k", 1)

	require.Equal(t, 3, pgtest.BreakIdle(t, pool))
	h, err := r.Health(e.ctx)
	require.NoError(t, err, "Health on a pool whose connections a restart broke")
	require.Equal(t, int64(1), h.Pending)

	require.Equal(t, 1, pgtest.BreakIdle(t, pool), "the pool opened one connection after the broken ones")
	rep := r.Check(e.ctx)
	require.True(t, reportChecks(rep)["outbox"], "%+v", rep)
	require.Contains(t, rep.Checks[2].Detail, "1 pending")
}
