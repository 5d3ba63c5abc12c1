package pgtest

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// RoundTrips records every round trip a pool's connections make: the
// statements of a query, or of a batch (a pipeline), by backend. Tests use
// it to count what a path sends, on the wire.
type RoundTrips struct {
	mu  sync.Mutex
	rts []RoundTrip
	// width is the width check of the pool it was made like, if any,
	// which its statements go through too.
	width *widthCheck
}

// RoundTrip is one round trip: the backend's process id and the statements
// sent, in order.
type RoundTrip struct {
	PID   uint32
	Stmts []string
}

// Traced opens a pool like pool (at most maxConns connections) whose
// round trips are recorded, closed when the test ends.
func Traced(t testing.TB, pool *pgxpool.Pool, maxConns int32) (*pgxpool.Pool, *RoundTrips) {
	t.Helper()
	cfg := pool.Config().Copy()
	rt := &RoundTrips{}
	rt.width, _ = cfg.ConnConfig.Tracer.(*widthCheck)
	cfg.ConnConfig.Tracer = rt
	cfg.MaxConns = maxConns
	traced, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("pgtest: traced pool: %v", err)
	}
	t.Cleanup(traced.Close)
	return traced, rt
}

func (r *RoundTrips) add(c *pgx.Conn, stmts ...string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.rts = append(r.rts, RoundTrip{PID: c.PgConn().PID(), Stmts: stmts})
}

// TraceQueryStart records a query.
func (r *RoundTrips) TraceQueryStart(ctx context.Context, c *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.add(c, d.SQL)
	if r.width != nil {
		return r.width.TraceQueryStart(ctx, c, d)
	}
	return ctx
}

// TraceQueryEnd hands the query to the width check.
func (r *RoundTrips) TraceQueryEnd(ctx context.Context, c *pgx.Conn, d pgx.TraceQueryEndData) {
	if r.width != nil {
		r.width.TraceQueryEnd(ctx, c, d)
	}
}

// TraceBatchStart records a batch's statements.
func (r *RoundTrips) TraceBatchStart(ctx context.Context, c *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	stmts := make([]string, 0, len(d.Batch.QueuedQueries))
	for _, q := range d.Batch.QueuedQueries {
		stmts = append(stmts, q.SQL)
	}
	r.add(c, stmts...)
	return ctx
}

// TraceBatchQuery hands the batch's query to the width check.
func (r *RoundTrips) TraceBatchQuery(ctx context.Context, c *pgx.Conn, d pgx.TraceBatchQueryData) {
	if r.width != nil {
		r.width.TraceBatchQuery(ctx, c, d)
	}
}

// TraceBatchEnd hands the batch's end to the width check.
func (r *RoundTrips) TraceBatchEnd(ctx context.Context, c *pgx.Conn, d pgx.TraceBatchEndData) {
	if r.width != nil {
		r.width.TraceBatchEnd(ctx, c, d)
	}
}

// All returns every round trip so far, in order.
func (r *RoundTrips) All() []RoundTrip {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]RoundTrip(nil), r.rts...)
}

// ByBackend returns the round trips of each backend, in order.
func (r *RoundTrips) ByBackend() map[uint32][]RoundTrip {
	out := map[uint32][]RoundTrip{}
	for _, rt := range r.All() {
		out[rt.PID] = append(out[rt.PID], rt)
	}
	return out
}

// IsStmt reports whether sql begins with the keyword prefix (any case,
// leading space ignored).
func IsStmt(sql, prefix string) bool {
	return strings.HasPrefix(strings.ToUpper(strings.TrimSpace(sql)), strings.ToUpper(prefix))
}
