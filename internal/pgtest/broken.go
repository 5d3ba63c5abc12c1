package pgtest

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// RecentPool returns a pool of at most n connections to the server of
// [ConnString] that never pings a connection before handing it out, as a
// busy pool does (pgxpool pings only connections idle for a second or
// more), with n connections opened and idle. It is closed when the test
// ends.
func RecentPool(tb testing.TB, n int32) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(ConnString(tb))
	if err != nil {
		tb.Fatalf("pgtest: parse connection string: %v", err)
	}
	cfg.MaxConns, cfg.MinConns = n, 0
	withWidthCheck(tb, cfg.ConnConfig)
	cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	ctx, cancel := context.WithTimeout(context.Background(), schemaTimeout)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		tb.Fatalf("pgtest: create pool: %v", err)
	}
	tb.Cleanup(pool.Close)
	held := make([]*pgxpool.Conn, 0, n)
	for range n {
		c, err := pool.Acquire(ctx)
		if err != nil {
			tb.Fatalf("pgtest: open the pool's connections: %v", err)
		}
		held = append(held, c)
	}
	for _, c := range held {
		c.Release()
	}
	return pool
}

// BreakIdle terminates the server backends of every idle connection of
// pool, as a database restart would, and waits until they are gone; the
// pool still holds the connections, and the first query on each fails. It
// returns how many it broke.
func BreakIdle(tb testing.TB, pool *pgxpool.Pool) int {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), schemaTimeout)
	defer cancel()
	idle := pool.AcquireAllIdle(ctx)
	pids := make([]uint32, 0, len(idle))
	for _, c := range idle {
		pids = append(pids, c.Conn().PgConn().PID())
		c.Release()
	}
	if len(pids) == 0 {
		return 0
	}
	conn, err := pgx.Connect(ctx, ConnString(tb))
	if err != nil {
		tb.Fatalf("pgtest: connect to terminate backends: %v", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid", pids); err != nil {
		tb.Fatalf("pgtest: terminate backends %v: %v", pids, err)
	}
	for {
		var left int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1::int[])", pids).Scan(&left); err != nil {
			tb.Fatalf("pgtest: wait for backends %v to end: %v", pids, err)
		}
		if left == 0 {
			return len(pids)
		}
		if ctx.Err() != nil {
			tb.Fatalf("pgtest: backends %v still there after %s", pids, schemaTimeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
