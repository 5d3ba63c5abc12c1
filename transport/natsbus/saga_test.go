package natsbus_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/transport/natsbus"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

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

// service is one service's schema with a relay publishing its outbox to
// NATS.
func service(t *testing.T, js jetstream.JetStream) (*pgxpool.Pool, string) {
	t.Helper()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	w, err := natsbus.NewWriter(js, nil)
	require.NoError(t, err)
	r, err := relay.New(pool, w, &relay.Config{Schema: schema, PollInterval: 50 * time.Millisecond, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, r.Start(ctx))
	t.Cleanup(func() { require.NoError(t, r.Stop(context.Background())) })
	return pool, schema
}

// A saga whose steps call two participants over NATS, in the hybrid mode:
// the relays publish remote commands and replies with natsbus.Writer, the
// participants consume their command topics and the engine its replies
// through natsbus.Reader, and nothing else is configured for Kafka. One
// order completes; a declined one is compensated across the services.
func TestSagaCallsParticipantsOverNATS(t *testing.T) {
	t.Parallel()
	_, js := server(t)
	ctx := ctxT(t)
	const replies = "checkout.replies"
	require.NoError(t, natsbus.Setup(ctx, js, []string{replies, "inventory.commands", "payments.commands"},
		&natsbus.SetupOpts{Partitions: 3}))
	reader := func(group string, topics []string) *natsbus.Reader {
		r, err := natsbus.NewReader(js, group, topics, &natsbus.ReaderOpts{AckWait: 2 * time.Second, PullWait: 500 * time.Millisecond})
		require.NoError(t, err)
		return r
	}
	serve := func(p *participant.Participant, group, topic string) {
		r := reader(group, []string{topic})
		c, err := p.Inbox().NewConsumer(r, &inbox.ConsumerConfig{Handlers: p.Handlers()})
		require.NoError(t, err)
		require.NoError(t, c.Start(context.Background()))
		t.Cleanup(func() {
			require.NoError(t, c.Stop(context.Background()))
			require.NoError(t, r.Close())
		})
	}

	invPool, invSchema := service(t, js)
	moves := pgx.Identifier{invSchema, "moves"}.Sanitize()
	_, err := invPool.Exec(ctx, "CREATE TABLE "+moves+" (order_id text, move text)")
	require.NoError(t, err)
	inv, err := participant.New(invPool, &participant.Config{Consumer: "inventory", Schema: invSchema, Logger: quiet, ReplyTopics: []string{replies}})
	require.NoError(t, err)
	for _, kind := range []string{"reserve", "release"} {
		require.NoError(t, participant.Handle(inv, "inventory."+kind, func(ctx context.Context, tx pgx.Tx, c participant.Call[chargeCmd]) (struct{}, error) {
			_, err := tx.Exec(ctx, "INSERT INTO "+moves+" VALUES ($1, $2)", c.Command.OrderID, kind)
			return struct{}{}, err
		}))
	}
	serve(inv, "inventory", "inventory.commands")

	payPool, paySchema := service(t, js)
	charges := pgx.Identifier{paySchema, "charges"}.Sanitize()
	_, err = payPool.Exec(ctx, "CREATE TABLE "+charges+" (order_id text, amount int)")
	require.NoError(t, err)
	pay, err := participant.New(payPool, &participant.Config{Consumer: "payments", Schema: paySchema, Logger: quiet, ReplyTopics: []string{replies}})
	require.NoError(t, err)
	require.NoError(t, participant.Handle(pay, "payments.charge", func(ctx context.Context, tx pgx.Tx, c participant.Call[chargeCmd]) (charged, error) {
		if c.Command.Amount > 100 {
			return charged{}, steps.Permanent(steps.WithCode("card_declined", errors.New("the card was declined")))
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+charges+" VALUES ($1, $2)", c.Command.OrderID, c.Command.Amount)
		return charged{ChargeID: "ch_" + c.Command.OrderID}, err
	}))
	serve(pay, "payments", "payments.commands")

	ordPool, ordSchema := service(t, js)
	cmd := func(_ context.Context, _ *saga.StepRun, o *order) (any, error) {
		return chargeCmd{OrderID: o.OrderID, Amount: o.Amount}, nil
	}
	def := saga.Define("checkout",
		saga.Step[order]{Name: "reserve", Timeout: 10 * time.Second, Remote: &saga.Remote[order]{
			Topic: "inventory.commands", Type: "inventory.reserve", CompensateType: "inventory.release", Command: cmd}},
		saga.Step[order]{Name: "charge", Timeout: 10 * time.Second, Remote: &saga.Remote[order]{
			Topic: "payments.commands", Type: "payments.charge", Command: cmd,
			OnReply: func(_ context.Context, _ *saga.StepRun, o *order, result json.RawMessage) error {
				var r charged
				if err := json.Unmarshal(result, &r); err != nil {
					return err
				}
				o.ChargeID = r.ChargeID
				return nil
			}}},
	)
	engine, err := saga.New(ordPool, &saga.Config{Schema: ordSchema, Workers: 2, Logger: quiet, RescueInterval: time.Second,
		Kafka: &saga.KafkaConfig{ReplyTopic: replies, NewReader: func(group string, topics []string) saga.KafkaReader {
			return reader(group, topics)
		}}})
	require.NoError(t, err)
	require.NoError(t, engine.Register(def))
	require.Equal(t, []string{replies}, engine.CommandTopics(), "hybrid: only the replies come to the engine over the bus")
	require.NoError(t, engine.Start(ctx))
	t.Cleanup(func() { require.NoError(t, engine.Stop(context.Background())) })

	run := func(o order) *saga.Instance {
		st, err := saga.Start(ctx, engine, def, o, nil)
		require.NoError(t, err)
		return sagatest.WaitEnded(t, engine, st.ID, &sagatest.WaitOpts{Timeout: 30 * time.Second})
	}
	count := func(pool *pgxpool.Pool, q string) int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, q).Scan(&n))
		return n
	}

	ok := run(order{OrderID: "o-1", Amount: 40})
	require.Equal(t, saga.StatusCompleted, ok.Status)
	var state order
	require.NoError(t, ok.DecodeState(&state))
	require.Equal(t, "ch_o-1", state.ChargeID, "the reply came back over NATS into the saga's state")

	declined := run(order{OrderID: "o-2", Amount: 500})
	require.Equal(t, saga.StatusCompensated, declined.Status)
	// The participant's refusal itself, not a reply timeout: it names the
	// command it answers, and the bus carried the command's id unchanged.
	require.NotNil(t, declined.LastError)
	require.Equal(t, "card_declined", declined.LastError.Code)

	require.Equal(t, 1, count(invPool, "SELECT count(*) FROM "+moves+" WHERE order_id = 'o-1' AND move = 'reserve'"))
	require.Equal(t, 0, count(invPool, "SELECT count(*) FROM "+moves+" WHERE order_id = 'o-1' AND move = 'release'"))
	require.Equal(t, 1, count(invPool, "SELECT count(*) FROM "+moves+" WHERE order_id = 'o-2' AND move = 'release'"),
		"the declined order's reservation was released over NATS")
	require.Equal(t, 1, count(payPool, "SELECT count(*) FROM "+charges))
	for pool, schema := range map[*pgxpool.Pool]string{invPool: invSchema, payPool: paySchema, ordPool: ordSchema} {
		require.Zero(t, count(pool, "SELECT count(*) FROM "+pgx.Identifier{schema, "dead_letters"}.Sanitize()), "nothing dead-lettered in %s", schema)
	}
}
