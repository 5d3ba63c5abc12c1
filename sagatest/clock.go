package sagatest

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/saga"
)

// AdvancePayload is the payload of the notification [Clock.Advance] sends
// on the schema's channel to wake the engines and relays listening there.
const AdvancePayload = "sagatest.advance"

// advanceLockTimeout bounds each wait of Advance for a row that an engine's
// transaction holds; Advance then tries again, so that it never holds a
// row an engine waits for long enough to deadlock with it.
const advanceLockTimeout = 100 * time.Millisecond

// Clock is the database time of one schema, as sagaflow sees it. sagaflow
// keeps every deadline in database time (rows hold "due at" times that are
// compared with now()), so a test cannot move a clock in the process to make
// an hour pass. [Clock.Advance] moves the rows instead: every time sagaflow
// stored in the schema moves d into the past, which is what the engine would
// see had d passed.
type Clock struct {
	pool    *pgxpool.Pool
	schema  string
	channel string // the schema's notification channel (store.Store.Channel)
	err     error  // an invalid schema, returned by Advance
	engines []*saga.Engine
}

// NewClock returns the clock of schema. Advance runs the stuck-saga rescuer
// of each engine given ([saga.Engine.RescueNow]) once it has moved the rows:
// give the engines that run the schema's sagas (one is enough).
func NewClock(pool *pgxpool.Pool, schema string, engines ...*saga.Engine) *Clock {
	c := &Clock{pool: pool, schema: schema, engines: engines}
	st, err := store.New(schema)
	switch {
	case pool == nil:
		c.err = errors.New("sagatest: clock: the pool is nil")
	case err != nil:
		c.err = fmt.Errorf("sagatest: clock: %w", err)
	default:
		c.channel = st.Channel()
	}
	return c
}

// Advance makes d pass for the schema's rows, then wakes what waits on
// them. It moves back by d, in one transaction:
//
//   - outbox.available_at: a step's retry backoff (RetryPolicy.Backoff,
//     steps.RetryAfter), a relay's publish backoff, a Kafka-mode command held
//     back because its saga was busy;
//   - outbox.created_at and published_at: the age of a Postgres-only command
//     for a saga or step no engine here knows (Config.UnknownSagaGrace), and
//     how long a published command counts as in flight;
//   - saga_instances.next_check_at and due_at: every saga's rescue deadline, so the
//     rescuer finds lost commands, and a remote step's reply timeout (its
//     step's Timeout) passes; wait_until, the end of a wait (a timer, a
//     signal's or child's time limit), whose command is an outbox row due
//     then; deadline_at, the saga's own deadline; and created_at,
//     updated_at, ended_at;
//   - saga_history.at, inbox.processed_at, dead_letters.created_at and
//     requeued_at, saga_cancel_requests.requested_at, saga_signals.created_at
//     and delivered_at, so that retention
//     (Engine.RunRetention) and listings see the same world;
//   - saga_branches.started_at and ended_at: how long a parallel step's
//     branch has run, which the rescuer reads to find a branch whose
//     command was lost and to send a remote branch's lost timeout again
//     due when it was due.
//
// Then it notifies the schema's channel ("<schema>_sagaflow", payload
// [AdvancePayload]), which wakes the engines' workers and the relays on the
// schema, and runs RescueNow on the clock's engines.
//
// What Advance cannot move is time inside a process: a step handler's
// context deadline (Step.Timeout of a step with an Action), the engine's
// HandlerGrace, the backoff of a Kafka consumer retrying a message in
// process (the engine's or an inbox.Consumer's), intervals of the scheduler
// (RescueInterval, RetentionInterval, Schedule's cron slots), and the time
// a Kafka-mode command for an unknown saga has been held (carried in a
// message header, not in a column). The idempotency package's keys are not
// moved either.
//
// Advance takes the rows it moves, so it waits for the transactions of
// running steps that hold them (a step's own timeout bounds that wait):
// time cannot pass in the middle of a running step. So a step handler must
// not block until the test advances the clock: Advance waits for it as long
// as ctx allows. Let such a handler return steps.RetryAfter until the test
// is ready, then advance past the retry.
//
// d must be positive (an error otherwise): time only moves forward.
//
// Rows written after Advance read them are not moved: wait until the engine
// has written what should come due (say, Wait for Event("step_failed:charge")
// before advancing past its retry's backoff), then Advance.
func (c *Clock) Advance(ctx context.Context, d time.Duration) error {
	if c.err != nil {
		return c.err
	}
	if d <= 0 {
		return fmt.Errorf("sagatest: advance %s: d must be positive", d)
	}
	s := pgx.Identifier{c.schema}.Sanitize()
	by := d.Microseconds()
	shift := func(col string) string {
		return col + " = " + col + " - $1 * interval '1 microsecond'"
	}
	stmts := []string{
		`UPDATE ` + s + `.saga_instances SET ` + shift("next_check_at") + `, ` + shift("due_at") + `, ` + shift("created_at") + `, ` +
			shift("updated_at") + `, ` + shift("ended_at") + `, ` + shift("wait_until") + `, ` + shift("deadline_at"),
		`UPDATE ` + s + `.outbox SET ` + shift("available_at") + `, ` + shift("created_at") + `, ` + shift("published_at") + `, ` +
			shift("paused_from"),
		`UPDATE ` + s + `.saga_pauses SET ` + shift("paused_at"),
		`UPDATE ` + s + `.saga_history SET ` + shift("at"),
		`UPDATE ` + s + `.inbox SET ` + shift("processed_at"),
		`UPDATE ` + s + `.dead_letters SET ` + shift("created_at") + `, ` + shift("requeued_at"),
		`UPDATE ` + s + `.saga_cancel_requests SET ` + shift("requested_at"),
		`UPDATE ` + s + `.saga_signals SET ` + shift("created_at") + `, ` + shift("delivered_at"),
		`UPDATE ` + s + `.saga_branches SET ` + shift("started_at") + `, ` + shift("ended_at"),
	}
	for attempt := 1; ; attempt++ {
		err := pgx.BeginFunc(ctx, c.pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, fmt.Sprintf("SET LOCAL lock_timeout = %d", advanceLockTimeout.Milliseconds())); err != nil {
				return err
			}
			for _, q := range stmts {
				if _, err := tx.Exec(ctx, q, by); err != nil {
					return err
				}
			}
			return nil
		})
		if err == nil {
			break
		}
		if !pgerr.Lock(err) {
			return fmt.Errorf("sagatest: advance schema %s by %s: %w", c.schema, d, err)
		}
		// An engine's transaction holds a row: let it finish.
		t := time.NewTimer(time.Duration(min(attempt, 10)) * 10 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("sagatest: advance schema %s by %s: %w (rows stayed locked)", c.schema, d, ctx.Err())
		case <-t.C:
		}
	}
	if _, err := c.pool.Exec(ctx, "SELECT pg_notify($1, $2)", c.channel, AdvancePayload); err != nil {
		return fmt.Errorf("sagatest: advance schema %s: notify: %w", c.schema, err)
	}
	for _, e := range c.engines {
		if _, err := e.RescueNow(ctx); err != nil {
			return fmt.Errorf("sagatest: advance schema %s: %w", c.schema, err)
		}
	}
	return nil
}
