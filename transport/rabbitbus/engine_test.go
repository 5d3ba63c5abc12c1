package rabbitbus_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/transport/rabbitbus"
)

type order struct {
	OrderID  string `json:"order_id"`
	Amount   int    `json:"amount"`
	ChargeID string `json:"charge_id,omitempty"`
}

type chargeCmd struct {
	OrderID string `json:"order_id"`
	Amount  int    `json:"amount"`
}

type charged struct {
	ChargeID string `json:"charge_id"`
}

// service is a schema with a relay publishing its outbox to RabbitMQ.
func (e *env) service(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(e.ctx, pool, schema)
	require.NoError(t, err)
	r, err := relay.New(pool, e.writer(t), &relay.Config{Schema: schema, PollInterval: 50 * time.Millisecond, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() { require.NoError(t, r.Stop(context.Background())) })
	return pool, schema
}

// A saga with a local step and a remote one, whose participant (a payment
// service) is reached over RabbitMQ: the engine's relay publishes the
// command, the participant consumes it through a Reader and replies
// through its own relay, and the engine consumes the reply through a
// Reader given as KafkaConfig.NewReader. A declined charge compensates the
// local step. In Kafka mode every step command goes over RabbitMQ too.
func TestSagaWithARemoteParticipantOverRabbitMQ(t *testing.T) {
	t.Parallel()
	for _, allSteps := range []bool{false, true} {
		t.Run(map[bool]string{false: "hybrid", true: "all-steps"}[allSteps], func(t *testing.T) {
			t.Parallel()
			e := setup(t, 3)
			const paymentsTopic = "payments.commands"

			// Payments: a participant serving its command topic.
			payPool, paySchema := e.service(t)
			_, err := payPool.Exec(e.ctx, "CREATE TABLE "+pgx.Identifier{paySchema, "charges"}.Sanitize()+" (order_id text, amount int)")
			require.NoError(t, err)
			pay, err := participant.New(payPool, &participant.Config{Consumer: "payments", Schema: paySchema, Logger: quiet})
			require.NoError(t, err)
			require.NoError(t, participant.Handle(pay, "payments.charge",
				func(ctx context.Context, tx pgx.Tx, c participant.Call[chargeCmd]) (charged, error) {
					if c.Command.Amount > 100 {
						return charged{}, steps.Permanent(steps.WithCode("card_declined", errors.New("the card was declined")))
					}
					_, err := tx.Exec(ctx, "INSERT INTO "+pgx.Identifier{paySchema, "charges"}.Sanitize()+" VALUES ($1, $2)",
						c.Command.OrderID, c.Command.Amount)
					return charged{ChargeID: "ch_" + c.Command.OrderID}, err
				}))
			payGroup := e.name("payments")
			e.setupGroups(t, []string{paymentsTopic}, payGroup)
			pc, err := pay.Inbox().NewConsumer(e.reader(t, payGroup, []string{paymentsTopic}, nil),
				&inbox.ConsumerConfig{Handlers: pay.Handlers()})
			require.NoError(t, err)
			start(t, pc)

			// Orders: the engine.
			ordPool, ordSchema := e.service(t)
			_, err = ordPool.Exec(e.ctx, "CREATE TABLE "+pgx.Identifier{ordSchema, "reservations"}.Sanitize()+" (order_id text, state text)")
			require.NoError(t, err)
			reservations := pgx.Identifier{ordSchema, "reservations"}.Sanitize()
			def := saga.Define("checkout",
				saga.Step[order]{Name: "reserve",
					Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
						_, err := run.Tx.Exec(ctx, "INSERT INTO "+reservations+" VALUES ($1, 'held')", o.OrderID)
						return err
					},
					Compensate: func(ctx context.Context, run *saga.StepRun, o *order) error {
						_, err := run.Tx.Exec(ctx, "UPDATE "+reservations+" SET state = 'released' WHERE order_id = $1", o.OrderID)
						return err
					}},
				saga.Step[order]{Name: "charge", Timeout: 10 * time.Second, Remote: &saga.Remote[order]{
					Topic: paymentsTopic, Type: "payments.charge",
					Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) {
						return chargeCmd{OrderID: o.OrderID, Amount: o.Amount}, nil
					},
					OnReply: func(_ context.Context, _ *saga.StepRun, o *order, result json.RawMessage) error {
						var r charged
						if err := json.Unmarshal(result, &r); err != nil {
							return err
						}
						o.ChargeID = r.ChargeID
						return nil
					},
				}},
			)
			engineGroup := e.name("engine")
			newReader := func(group string, topics []string) saga.KafkaReader {
				e.track(group, topics...)
				r, err := rabbitbus.NewReader(e.dial, group, topics, &rabbitbus.ReaderOpts{Topology: e.topo})
				if err != nil {
					panic(err) // options checked below: cannot happen
				}
				return r
			}
			eng, err := saga.New(ordPool, &saga.Config{Schema: ordSchema, Workers: 2, Logger: quiet, RescueInterval: time.Second,
				Kafka: &saga.KafkaConfig{GroupID: engineGroup, NewReader: newReader, AllSteps: allSteps}})
			require.NoError(t, err)
			require.NoError(t, eng.Register(def))
			// Deployment: the engine's queues exist before anything is
			// published to them (the readers would declare them too, once
			// connected).
			e.setupGroups(t, eng.CommandTopics(), engineGroup)
			if allSteps {
				require.Equal(t, []string{"sagaflow.commands.checkout", "sagaflow.commands.checkout.replies"}, eng.CommandTopics())
			} else {
				require.Equal(t, []string{"sagaflow.commands.checkout.replies"}, eng.CommandTopics())
			}
			require.NoError(t, eng.Start(context.Background()))
			t.Cleanup(func() { require.NoError(t, eng.Stop(context.Background())) })

			run := func(o order) *saga.Instance {
				st, err := saga.Start(e.ctx, eng, def, o, nil)
				require.NoError(t, err)
				return sagatest.WaitEnded(t, eng, st.ID, &sagatest.WaitOpts{Timeout: 30 * time.Second})
			}
			ok := run(order{OrderID: "o-1", Amount: 40})
			require.Equal(t, saga.StatusCompleted, ok.Status, "%+v", ok)
			var state order
			require.NoError(t, ok.DecodeState(&state))
			require.Equal(t, "ch_o-1", state.ChargeID, "the participant's reply reached the saga over RabbitMQ")

			declined := run(order{OrderID: "o-2", Amount: 500})
			require.Equal(t, saga.StatusCompensated, declined.Status, "%+v", declined)
			// The participant's refusal itself, not a reply timeout: it names the
			// command it answers, and the bus carried the command's id unchanged.
			require.NotNil(t, declined.LastError)
			require.Equal(t, "card_declined", declined.LastError.Code)
			require.Equal(t, 1, e.countOn(t, payPool, "SELECT count(*) FROM "+pgx.Identifier{paySchema, "charges"}.Sanitize()))
			require.Equal(t, 1, e.countOn(t, ordPool, "SELECT count(*) FROM "+reservations+" WHERE state = 'released'"))
			require.Equal(t, 1, e.countOn(t, ordPool, "SELECT count(*) FROM "+reservations+" WHERE state = 'held'"))
			for _, p := range []struct {
				pool   *pgxpool.Pool
				schema string
			}{{payPool, paySchema}, {ordPool, ordSchema}} {
				require.Zero(t, e.countOn(t, p.pool, fmt.Sprintf("SELECT count(*) FROM %s", pgx.Identifier{p.schema, "dead_letters"}.Sanitize())))
			}
		})
	}
}

func (e *env) countOn(t *testing.T, pool *pgxpool.Pool, q string) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(e.ctx, q).Scan(&n))
	return n
}
