package pgtest

import (
	"context"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// The width check: the pools this package makes fail their test when a
// statement sends a 64-bit Go integer (int64, uint64, uint32, uint or
// time.Duration) to a parameter that PostgreSQL typed as int4 or int2.
// Such a parameter works with small values and fails with "unable to
// encode … into binary format for int4" past 2^31: a RescueSlack of 36
// minutes (2^31 microseconds) in one such statement failed every transition
// of every saga, and only a test with a setting that large would have
// shown it. The check looks at the type, not the value, so the tests'
// small values show it.
//
// PostgreSQL infers a parameter's type from where it first appears: in
// `2 * $1` it is an int4, in `$1 * interval '1 microsecond'` a float8, in
// `$1::bigint` an int8. Cast it to bigint where a 64-bit value goes.
//
// How: after a statement with a 64-bit argument succeeds, the connection
// (idle again) describes it once more, unnamed, for its parameters' types;
// each distinct statement once per test process. Go int values are not
// checked: they go to int4 parameters in many statements (epochs, attempts,
// step indexes, limits) whose values are bounded.

// widths is what the check has described, across the process's pools.
var widths = struct {
	mu   sync.Mutex
	seen map[string]bool
}{seen: map[string]bool{}}

// widthDescribeTimeout bounds the describe: it runs on the test's
// connection, which a timed-out read would close.
const widthDescribeTimeout = time.Minute

// widthCheck is the pool's tracer: it fails tb on a narrow parameter.
type widthCheck struct {
	tb   testing.TB
	mu   sync.Mutex
	done bool // the test has ended: report no more to tb
	// pending holds the batch's statements to describe once it ends.
	pending map[*pgx.Conn][]widthQuery
}

type widthQuery struct {
	sql  string
	args []any
}

type widthStartKey struct{}

// withWidthCheck sets the pool's tracer to the width check of tb. A
// benchmark's pools go without it: a benchmark measures the statements,
// and the tests check them.
func withWidthCheck(tb testing.TB, cfg *pgx.ConnConfig) {
	if _, bench := tb.(*testing.B); bench {
		return
	}
	w := &widthCheck{tb: tb, pending: map[*pgx.Conn][]widthQuery{}}
	tb.Cleanup(func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		w.done = true
	})
	cfg.Tracer = w
}

// TraceQueryStart keeps the statement for TraceQueryEnd.
func (w *widthCheck) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if !anyWide(d.Args) {
		return ctx
	}
	return context.WithValue(ctx, widthStartKey{}, widthQuery{sql: d.SQL, args: d.Args})
}

// TraceQueryEnd checks a statement that succeeded.
func (w *widthCheck) TraceQueryEnd(ctx context.Context, c *pgx.Conn, d pgx.TraceQueryEndData) {
	q, ok := ctx.Value(widthStartKey{}).(widthQuery)
	if !ok || d.Err != nil {
		return
	}
	w.check(ctx, c, q)
}

// TraceBatchStart does nothing.
func (w *widthCheck) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

// TraceBatchQuery keeps a statement of the batch for its end, when the
// connection is free.
func (w *widthCheck) TraceBatchQuery(_ context.Context, c *pgx.Conn, d pgx.TraceBatchQueryData) {
	if d.Err != nil || !anyWide(d.Args) {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.pending[c] = append(w.pending[c], widthQuery{sql: d.SQL, args: d.Args})
}

// TraceBatchEnd checks the batch's statements.
func (w *widthCheck) TraceBatchEnd(ctx context.Context, c *pgx.Conn, d pgx.TraceBatchEndData) {
	w.mu.Lock()
	qs := w.pending[c]
	delete(w.pending, c)
	w.mu.Unlock()
	if d.Err != nil {
		return
	}
	for _, q := range qs {
		w.check(ctx, c, q)
	}
}

// check describes q's statement, if no pool has yet, and reports each
// 64-bit argument that goes to an int4 or int2 parameter.
func (w *widthCheck) check(ctx context.Context, c *pgx.Conn, q widthQuery) {
	widths.mu.Lock()
	seen := widths.seen[q.sql]
	widths.mu.Unlock()
	if seen || c.IsClosed() || c.PgConn().TxStatus() == 'E' {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), widthDescribeTimeout)
	defer cancel()
	sd, err := c.PgConn().Prepare(ctx, "", q.sql, nil)
	if err != nil {
		return // described by a later call, or never; the statement itself worked
	}
	widths.mu.Lock()
	widths.seen[q.sql] = true
	widths.mu.Unlock()
	if problems := narrowParams(sd.ParamOIDs, q.args); len(problems) > 0 {
		w.report(fmt.Sprintf("pgtest: a 64-bit value goes to a narrower parameter (cast it to bigint): %s\n  in: %s",
			strings.Join(problems, "; "), compactSQL(q.sql)))
	}
}

// narrowParams names each 64-bit argument sent to an int4 or int2 parameter.
func narrowParams(oids []uint32, args []any) []string {
	if len(oids) != len(args) {
		return nil // arguments pgx takes itself (result formats, rewriters)
	}
	var out []string
	for i, oid := range oids {
		if (oid == pgtype.Int4OID || oid == pgtype.Int2OID) && wide(args[i]) {
			name := "int4"
			if oid == pgtype.Int2OID {
				name = "int2"
			}
			out = append(out, fmt.Sprintf("$%d is %s and gets a %T", i+1, name, args[i]))
		}
	}
	return out
}

func (w *widthCheck) report(msg string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.tb.Error(msg)
	}
}

func anyWide(args []any) bool {
	for _, a := range args {
		if wide(a) {
			return true
		}
	}
	return false
}

// wide reports whether a is a Go integer of 64 bits (or 32 unsigned) other
// than int, or a pointer to one.
func wide(a any) bool {
	v := reflect.ValueOf(a)
	for v.Kind() == reflect.Pointer {
		if v.IsNil() {
			return false
		}
		v = v.Elem()
	}
	switch v.Kind() {
	case reflect.Int64, reflect.Uint64, reflect.Uint32, reflect.Uint, reflect.Uintptr:
		return true
	}
	return false
}

// compactSQL is sql on one line, at most 300 bytes.
func compactSQL(sql string) string {
	s := strings.Join(strings.Fields(sql), " ")
	if len(s) > 300 {
		s = s[:300] + "…"
	}
	return s
}
