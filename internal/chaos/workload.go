package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// The workload: an order saga in the orders schema whose middle step is a
// remote call to a payments participant in its own schema, over Kafka.
//
//	reserve  local:  a ledger row; compensated by another ledger row
//	charge   remote: the participant writes a payment and a ledger row and
//	                 calls the bank; refunded by a remote compensation
//	ship     local:  calls the carrier, then a ledger row; refuses orders
//	                 marked Fail, so those sagas compensate
//
// Orders marked Slow run as a second saga type, the same steps with the
// charge sent to a topic of their own, where the participant answers only
// after the step's timeout: the rescuer fails the step over and the saga
// compensates while the late reply is on its way. (The topic is their own
// because a participant's consumer handles one message at a time: a slow
// answer would hold up every order behind it.)
//
// Orders marked DBFail see ship fail with a unique violation, through the
// step's transaction, on their first DBFail attempts: the step is retried
// and completes. Orders marked DBFatal see it fail with a division by zero,
// which the step reports as permanent: the saga compensates. Either way
// ship's ledger row, written before the failing statement in the same
// transaction, must be rolled back with it. Orders marked Linger wait in
// reserve for LingerFor, honouring their context, so that an operator's
// cancel can reach a running step. Orders marked Stall run, on reserve's
// first attempt, a statement longer than reserve's Timeout after writing
// their ledger row: the timeout must cut the statement on the server,
// record the attempt as step_timeout and undo the row with the step's
// savepoint, and the second attempt must complete the step (a statement
// not cut holds its handler past HandlerGrace, which the crash matrix
// refuses: see Report.Uncut). Orders marked Dawdle wait in ship for
// DawdleFor, honouring their context: in the hybrid mode ship runs at once
// after charge's reply, on the Kafka worker that applied it, and past
// KafkaConfig.ReplyStepLimit it is given up there, the reply applied again
// on its own with ship's command, and an engine worker runs ship (for a
// minute after, that engine runs ship on a worker from the start).
//
// A third saga type, [ForeignSagaName], is registered by no node: the
// parent starts sagas of it whose commands it routes to the order saga's
// command topic, as a newer engine would during a rolling deploy. The
// engines hold each one (back to the outbox) and park it after
// UnknownSagaGrace.
const (
	OrdersSchema   = "orders"
	PaymentsSchema = "payments"
	LedgerSchema   = "chaos"

	SagaName      = "order"
	SlowSagaName  = "order-slow"
	PaymentsTopic = "payments.commands"
	SlowTopic     = "payments.slow"
	ChargeType    = "payments.charge"
	RefundType    = "payments.refund"

	// ChargeTimeout is the remote step's timeout: longer than a consumer
	// group takes to hand a killed node's partitions on. A Slow order's
	// reply comes SlowReply after its command.
	ChargeTimeout = 5 * time.Second
	SlowReply     = 6 * time.Second

	// LingerFor is how long reserve waits for a Linger order.
	LingerFor = 3 * time.Second
	// DawdleFor is how long ship waits for a Dawdle order: twice the
	// engine's default ReplyStepLimit.
	DawdleFor = 2 * saga.ReplyStepLimitDefault

	// ReserveTimeout is reserve's Timeout: longer than LingerFor, so a
	// lingering order is cut by its cancel, not by the timeout. A Stall
	// order's statement on reserve's first attempt sleeps StallFor, past it.
	ReserveTimeout = LingerFor + 2*time.Second
	StallFor       = 3 * ReserveTimeout

	// ForeignSagaName is a saga type no node registers (see above).
	ForeignSagaName = "order-next"
	// UnknownSagaGrace is the engines' grace for commands they do not
	// know: short, so that the foreign sagas' commands are parked well
	// within a cell's deadline.
	UnknownSagaGrace = 6 * time.Second
)

// SigningKey signs every command and reply of the system (the engines and
// the participant share it); the poison includes forgeries without it.
var SigningKey = []byte("sagaflow chaos: the key every service of the bus shares")

// Order is the saga's state.
type Order struct {
	Key     string `json:"key"`
	Fail    bool   `json:"fail,omitempty"`
	Slow    bool   `json:"slow,omitempty"`
	DBFail  int    `json:"db_fail,omitempty"`
	DBFatal bool   `json:"db_fatal,omitempty"`
	Linger  bool   `json:"linger,omitempty"`
	Stall   bool   `json:"stall,omitempty"`
	Dawdle  bool   `json:"dawdle,omitempty"`
	Paid    bool   `json:"paid,omitempty"`
}

type chargeCmd struct {
	Key  string `json:"key"`
	Slow bool   `json:"slow,omitempty"`
	// Sent is when the engine built the command. A slow charge answers
	// SlowReply after it, however long it waited in the queue, so that slow
	// orders queued together do not add up.
	Sent time.Time `json:"sent"`
}

// Topics lists every topic the workload uses, to seed the broker with. The
// order saga's command topic comes first.
func Topics() []string {
	var out []string
	for _, name := range []string{SagaName, SlowSagaName, ParcelSagaName, LabelSagaName} {
		out = append(out, saga.CommandTopicDefault+"."+name, saga.CommandTopicDefault+"."+name+".replies")
	}
	return append(out, PaymentsTopic, SlowTopic)
}

// Ledger is the effects ledger: every database effect a step body makes is
// also a row here, in the same transaction. It has no unique key on
// purpose, so a doubled effect shows as two rows.
func Ledger() string { return pgx.Identifier{LedgerSchema, "ledger"}.Sanitize() }

// Setup migrates the two sagaflow schemas and creates the ledger, the
// participant's business table and the table of signal requests. It is safe to run again.
func Setup(ctx context.Context, pool *pgxpool.Pool) error {
	for _, s := range []string{OrdersSchema, PaymentsSchema} {
		if _, err := migrations.Migrate(ctx, pool, s); err != nil {
			return fmt.Errorf("chaos: migrate %s: %w", s, err)
		}
	}
	_, err := pool.Exec(ctx, `
CREATE SCHEMA IF NOT EXISTS `+LedgerSchema+`;
CREATE TABLE IF NOT EXISTS `+Ledger()+` (
    order_key text        NOT NULL,
    step      text        NOT NULL,
    direction text        NOT NULL,
    pid       integer     NOT NULL,
    at        timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS `+payments()+` (
    order_key text PRIMARY KEY,
    step_key  text NOT NULL
);
CREATE TABLE IF NOT EXISTS `+uniqueProbe()+` (k text PRIMARY KEY);`+fmt.Sprintf(signalRequestsDDL, signalRequests()))
	if err != nil {
		return fmt.Errorf("chaos: create the ledger: %w", err)
	}
	return nil
}

func payments() string { return pgx.Identifier{PaymentsSchema, "payments"}.Sanitize() }

// uniqueProbe is a table nothing is ever written to: inserting the same key
// twice in one statement is a unique violation.
func uniqueProbe() string { return pgx.Identifier{LedgerSchema, "unique_probe"}.Sanitize() }

// CodeDBData is the code of ship's permanent database failure.
const CodeDBData = "db_data_exception"

// failInDB fails the step with a real PostgreSQL error through its
// transaction, when the order asks for one on this attempt.
func failInDB(ctx context.Context, run *saga.StepRun, o *Order) error {
	switch {
	case o.DBFatal:
		// A data exception fails the same way on every try: permanent.
		_, err := run.Tx.Exec(ctx, "SELECT 1 / $1::int", 0)
		if pgerr.Content(err) {
			return steps.Permanent(steps.WithCode(CodeDBData, err))
		}
		if err == nil {
			err = errors.New("chaos: a division by zero did not fail")
		}
		return err
	case run.Attempt <= o.DBFail:
		_, err := run.Tx.Exec(ctx, "INSERT INTO "+uniqueProbe()+" (k) VALUES ($1), ($1)", o.Key)
		if err == nil {
			err = errors.New("chaos: a unique violation did not fail")
		}
		return err
	}
	return nil
}

// execer is a transaction or, in the broken workload, a pool.
type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

func record(ctx context.Context, tx execer, pid int, order, step string, dir steps.Direction) error {
	_, err := tx.Exec(ctx, "INSERT INTO "+Ledger()+" (order_key, step, direction, pid) VALUES ($1, $2, $3, $4)",
		order, step, string(dir), pid)
	return err
}

// External is a client of the fake external service (see [Service]).
type External struct {
	URL    string
	Client *http.Client
}

// Call makes one call to the external service under an idempotency key.
func (x External) Call(ctx context.Context, op, key string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, x.URL+"/"+op, strings.NewReader("{}"))
	if err != nil {
		return err
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := x.Client.Do(req)
	if err != nil {
		return fmt.Errorf("external %s: %w", op, err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("external %s: status %d", op, resp.StatusCode)
	}
	return nil
}

// Definitions are the order saga and its slow twin; pid goes into the
// ledger rows the process writes. With broken set, the local steps write
// their ledger rows through it, outside the step's transaction: the mistake
// the checkers must catch (see [SabotageEffectsOutsideTx]).
func Definitions(x External, pid int, broken *pgxpool.Pool) (normal, slow *saga.Definition[Order]) {
	return definition(SagaName, PaymentsTopic, x, pid, broken), definition(SlowSagaName, SlowTopic, x, pid, broken)
}

// ForeignDefinition is the saga type only the parent registers, to start
// sagas with; its step never runs anywhere.
func ForeignDefinition() *saga.Definition[Order] {
	return saga.Define(ForeignSagaName, saga.Step[Order]{Name: "reserve",
		Action: func(context.Context, *saga.StepRun, *Order) error {
			return errors.New("chaos: the foreign saga's step ran, but no node registers it")
		}})
}

func definition(name, topic string, x External, pid int, broken *pgxpool.Pool) *saga.Definition[Order] {
	local := func(step string, dir steps.Direction, call string) saga.StepFunc[Order] {
		return func(ctx context.Context, run *saga.StepRun, o *Order) error {
			if call != "" {
				if err := x.Call(ctx, call, run.IdempotencyKey()); err != nil {
					return err
				}
			}
			if broken != nil {
				return record(ctx, broken, pid, o.Key, step, dir)
			}
			return record(ctx, run.Tx, pid, o.Key, step, dir)
		}
	}
	ship := local("ship", steps.Forward, "carrier")
	reserve := local("reserve", steps.Forward, "")
	return saga.Define(name,
		saga.Step[Order]{Name: "reserve", Timeout: ReserveTimeout, Compensate: local("reserve", steps.Compensate, ""),
			Action: func(ctx context.Context, run *saga.StepRun, o *Order) error {
				if o.Stall && run.Attempt == 1 {
					return stall(ctx, run, reserve, o)
				}
				if o.Linger {
					select {
					case <-time.After(LingerFor):
					case <-ctx.Done():
						return ctx.Err()
					}
				}
				return reserve(ctx, run, o)
			}},
		// A refund is sent again until its reply comes, for as long as a
		// user would wait for one: a participant that fell behind (a
		// partition held by a killed node until its ack wait, a starved
		// machine) answers late, and five tries of 5 s each were spent
		// before it did on a loaded run, failing cancelled sagas for good.
		saga.Step[Order]{Name: "charge", Timeout: ChargeTimeout, CompensateRetry: &saga.RetryPolicy{MaxAttempts: 20,
			Backoff: saga.ExponentialBackoff(100*time.Millisecond, 2*time.Second)}, Remote: &saga.Remote[Order]{
			Topic: topic, Type: ChargeType, CompensateType: RefundType,
			Command: func(_ context.Context, _ *saga.StepRun, o *Order) (any, error) {
				return chargeCmd{Key: o.Key, Slow: o.Slow, Sent: time.Now()}, nil
			},
			OnReply: func(_ context.Context, _ *saga.StepRun, o *Order, _ json.RawMessage) error {
				o.Paid = true
				return nil
			},
		}},
		saga.Step[Order]{Name: "ship", Retry: &saga.RetryPolicy{MaxAttempts: 20, Backoff: saga.ExponentialBackoff(50*time.Millisecond, time.Second)},
			Action: func(ctx context.Context, run *saga.StepRun, o *Order) error {
				if o.Dawdle {
					select {
					case <-time.After(DawdleFor):
					case <-ctx.Done():
						return ctx.Err()
					}
				}
				if o.Fail {
					return steps.Permanent(steps.WithCode("undeliverable", errors.New("the carrier does not deliver there")))
				}
				if err := ship(ctx, run, o); err != nil {
					return err
				}
				return failInDB(ctx, run, o)
			}},
	)
}

// stall writes reserve's ledger row, then runs a statement for StallFor,
// past reserve's Timeout, on the step's transaction. The timeout must cut
// it (SQLSTATE 57014, the row undone with the step's savepoint).
func stall(ctx context.Context, run *saga.StepRun, reserve saga.StepFunc[Order], o *Order) error {
	if err := reserve(ctx, run, o); err != nil {
		return err
	}
	if _, err := run.Tx.Exec(ctx, "SELECT pg_sleep($1)", StallFor.Seconds()); err != nil {
		return err
	}
	return errors.New("chaos: a stalled statement ran to its end: its step's timeout did not cut it")
}

// Participant registers the payments handlers on p.
func Participant(p *participant.Participant, x External, pid int) error {
	err := participant.Handle(p, ChargeType, func(ctx context.Context, tx pgx.Tx, c participant.Call[chargeCmd]) (struct{}, error) {
		if c.Command.Slow {
			select {
			case <-time.After(time.Until(c.Command.Sent.Add(SlowReply))):
			case <-ctx.Done():
				return struct{}{}, ctx.Err()
			}
		}
		if err := x.Call(ctx, "bank/charge", c.Key.String()); err != nil {
			return struct{}{}, err
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+payments()+" (order_key, step_key) VALUES ($1, $2)", c.Command.Key, c.Key.String()); err != nil {
			return struct{}{}, err
		}
		return struct{}{}, record(ctx, tx, pid, c.Command.Key, "charge", steps.Forward)
	})
	if err != nil {
		return err
	}
	return participant.Handle(p, RefundType, func(ctx context.Context, tx pgx.Tx, c participant.Call[chargeCmd]) (struct{}, error) {
		// Refund only what was charged: after a reply timeout the charge
		// may never have happened.
		tag, err := tx.Exec(ctx, "DELETE FROM "+payments()+" WHERE order_key = $1", c.Command.Key)
		if err != nil || tag.RowsAffected() == 0 {
			return struct{}{}, err
		}
		if err := x.Call(ctx, "bank/refund", c.Key.String()); err != nil {
			return struct{}{}, err
		}
		return struct{}{}, record(ctx, tx, pid, c.Command.Key, "charge", steps.Compensate)
	})
}
