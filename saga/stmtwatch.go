package saga

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// A step's statements on run.Tx, given the step's context, must not end
// the batch when that context ends: pgx answers a context that ends during
// a statement by closing the connection, and the batch's transaction (every
// saga of the batch) went with it. The step's attempt was then never
// recorded: a step whose Timeout ended inside a statement ran again, batch
// after batch, past MaxAttempts and for ever (found by review31).
//
// So a step's statement runs with the batch's context (its values are the
// step's: a trace's span goes with it), and when the step's context ends
// while the statement runs, the statement is cancelled on the server with a
// cancel request: the statement fails with SQLSTATE 57014, the step's
// savepoint undoes its writes, the connection lives on, and the attempt is
// recorded as timed out (or the cancel request applied). A statement begun
// after the step's context ended is not sent. Should the cancel request not
// reach the server, the step runs on until HandlerGrace and is abandoned,
// as a handler that ignores its context is.

// statementCancelTimeout bounds a cancel request: a new connection to the
// server that asks it to cancel the statement running on the batch's.
const statementCancelTimeout = 5 * time.Second

// stmtContext is a step statement's context: the batch's, which ends only
// when the engine stops hard, with the step's values.
type stmtContext struct {
	context.Context
	values context.Context
}

func (c stmtContext) Value(key any) any { return c.values.Value(key) }

// watch prepares a statement of the step that runs on conn with the step's
// ctx: it returns the context to run it with and the function to call once
// it (its rows or batch results included) is done, or ctx's error if ctx
// has ended already. Until done is called, ctx's end sends a cancel
// request; done waits for one that is under way, so that it cannot
// cancel a later statement on the connection.
func (t stepTx) watch(ctx context.Context) (context.Context, func(), error) {
	if err := ctx.Err(); err != nil {
		return nil, nil, err
	}
	// The engine's own statements on the step's transaction come with the
	// batch's context: nothing to watch.
	batch := t.bt.ctx
	if ctx == batch || ctx.Done() == nil {
		return ctx, func() {}, nil
	}
	conn := t.Tx.Conn()
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(fired)
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), statementCancelTimeout)
		defer cancel()
		_ = conn.PgConn().CancelRequest(cctx)
	})
	var once sync.Once
	done := func() {
		once.Do(func() {
			if !stop() {
				<-fired
			}
		})
	}
	return stmtContext{Context: batch, values: ctx}, done, nil
}

// watchedRows ends its statement's watch when the rows are done.
type watchedRows struct {
	pgx.Rows
	done func()
}

func (r *watchedRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.done()
	return false
}

func (r *watchedRows) Close() {
	r.Rows.Close()
	r.done()
}

// watchedRow ends its statement's watch once scanned.
type watchedRow struct {
	pgx.Row
	done func()
}

func (r watchedRow) Scan(dest ...any) error {
	defer r.done()
	return r.Row.Scan(dest...)
}

// watchedBatch ends its statements' watch when closed.
type watchedBatch struct {
	pgx.BatchResults
	done func()
}

func (b watchedBatch) Close() error {
	defer b.done()
	return b.BatchResults.Close()
}

// nestedTx is a savepoint a step began on run.Tx: its statements are
// watched as the step's own are.
type nestedTx struct {
	pgx.Tx
	step stepTx
}

func (n nestedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	sctx, done, err := n.step.watch(ctx)
	if err != nil {
		return nil, err
	}
	defer done()
	tx, err := n.Tx.Begin(sctx)
	if err != nil {
		return nil, err
	}
	return nestedTx{Tx: tx, step: n.step}, nil
}

func (n nestedTx) Commit(ctx context.Context) error {
	return watched(n.step, ctx, func(ctx context.Context) error { return n.Tx.Commit(ctx) })
}

func (n nestedTx) Rollback(ctx context.Context) error {
	return watched(n.step, ctx, func(ctx context.Context) error { return n.Tx.Rollback(ctx) })
}

func (n nestedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	var tag pgconn.CommandTag
	err := watched(n.step, ctx, func(ctx context.Context) (err error) {
		tag, err = n.Tx.Exec(ctx, sql, args...)
		return err
	})
	return tag, err
}

func (n nestedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	sctx, done, err := n.step.watch(ctx)
	if err != nil {
		rows, _ := n.Tx.Query(ctx, sql, args...) // ctx has ended: pgx reports it on the rows
		return rows, err
	}
	rows, err := n.Tx.Query(sctx, sql, args...)
	if err != nil {
		done()
		return rows, err
	}
	return &watchedRows{Rows: rows, done: done}, nil
}

func (n nestedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	sctx, done, err := n.step.watch(ctx)
	if err != nil {
		return errRow{err}
	}
	return watchedRow{Row: n.Tx.QueryRow(sctx, sql, args...), done: done}
}

func (n nestedTx) SendBatch(ctx context.Context, q *pgx.Batch) pgx.BatchResults {
	sctx, done, err := n.step.watch(ctx)
	if err != nil {
		return n.Tx.SendBatch(ctx, q) // ctx has ended: pgx sends nothing and reports it
	}
	return watchedBatch{BatchResults: n.Tx.SendBatch(sctx, q), done: done}
}

func (n nestedTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	var rows int64
	err := watched(n.step, ctx, func(ctx context.Context) (err error) {
		rows, err = n.Tx.CopyFrom(ctx, table, columns, src)
		return err
	})
	return rows, err
}

func (n nestedTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	var sd *pgconn.StatementDescription
	err := watched(n.step, ctx, func(ctx context.Context) (err error) {
		sd, err = n.Tx.Prepare(ctx, name, sql)
		return err
	})
	return sd, err
}

// watched runs f, a statement of step t, under t's watch of ctx.
func watched(t stepTx, ctx context.Context, f func(ctx context.Context) error) error {
	sctx, done, err := t.watch(ctx)
	if err != nil {
		return err
	}
	defer done()
	return f(sctx)
}
