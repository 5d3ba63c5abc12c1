package saga_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// roundTrips records every round trip a pool's connections make: the
// statements of a query, or of a batch (a pipeline), by backend.
type roundTrips struct {
	mu  sync.Mutex
	rts []roundTrip
}

type roundTrip struct {
	pid   uint32
	stmts []string
}

func (r *roundTrips) add(c *pgx.Conn, stmts ...string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.rts = append(r.rts, roundTrip{pid: c.PgConn().PID(), stmts: stmts})
}

func (r *roundTrips) TraceQueryStart(ctx context.Context, c *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.add(c, d.SQL)
	return ctx
}

func (r *roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (r *roundTrips) TraceBatchStart(ctx context.Context, c *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	var stmts []string
	for _, q := range d.Batch.QueuedQueries {
		stmts = append(stmts, q.SQL)
	}
	r.add(c, stmts...)
	return ctx
}

func (r *roundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (r *roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// byBackend returns the round trips of each backend, in order.
func (r *roundTrips) byBackend() map[uint32][]roundTrip {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[uint32][]roundTrip{}
	for _, rt := range r.rts {
		out[rt.pid] = append(out[rt.pid], rt)
	}
	return out
}

func isStmt(sql, prefix string) bool {
	return strings.HasPrefix(strings.ToUpper(strings.TrimSpace(sql)), prefix)
}

// A Postgres-only batch spends no round trip on BEGIN or on COMMIT alone:
// BEGIN goes with the claim, and COMMIT with the batch's tail (leaving its
// savepoints, deleting the commands it ran). Counted on the wire, from the
// pool's tracer.
func TestAStepBatchBeginsWithItsClaimAndCommitsWithItsTail(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	cfg := b.pool.Config().Copy()
	trace := &roundTrips{}
	cfg.ConnConfig.Tracer = trace
	cfg.MaxConns = 4
	traced, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(traced.Close)
	b.engine, err = saga.New(traced, &saga.Config{Schema: b.schema, Workers: 1, PollInterval: 100 * time.Millisecond,
		Logger: testLogger(t)})
	require.NoError(t, err)
	def := threeSteps(b, "roundtrips", nil)
	require.NoError(t, b.engine.Register(def))
	b.start(t)

	ctx := context.Background()
	tx, err := b.pool.Begin(ctx) // the start is the caller's, on a pool not traced
	require.NoError(t, err)
	st, err := saga.StartTx(ctx, b.engine, tx, def, order{OrderID: "o-rt"}, nil)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st.ID).Status)

	committed := 0
	for pid, rts := range trace.byBackend() {
		open := false
		for i, rt := range rts {
			claim := false
			for _, s := range rt.stmts {
				claim = claim || strings.Contains(s, "c.aggregatetype, c.type, c.payload")
			}
			if claim {
				require.True(t, isStmt(rt.stmts[0], "BEGIN"), "backend %d, round trip %d: the claim is not sent with BEGIN: %q", pid, i, rt.stmts)
				open = true
				continue
			}
			if !open {
				continue
			}
			if len(rt.stmts) == 1 {
				require.False(t, isStmt(rt.stmts[0], "COMMIT"), "backend %d, round trip %d: a COMMIT of its own", pid, i)
				if isStmt(rt.stmts[0], "ROLLBACK") && !strings.Contains(rt.stmts[0], "SAVEPOINT") {
					open = false // a claim that found nothing
				}
				continue
			}
			last := rt.stmts[len(rt.stmts)-1]
			if isStmt(last, "COMMIT") {
				require.True(t, isStmt(rt.stmts[0], "RELEASE SAVEPOINT"), "backend %d, round trip %d: COMMIT without the tail: %q", pid, i, rt.stmts)
				committed++
				open = false
			}
		}
	}
	require.GreaterOrEqual(t, committed, 1, "the steps' batches committed with their tails")
}
