// Package natssoak is a soak of sagas whose participant crosses NATS
// JetStream while the participant's processes are killed (SIGKILL) and
// paused (SIGSTOP) during redelivery: what kfake could not cover, on a real
// nats-server (issue #18). It runs in `make test`.
package natssoak

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/natstest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/transport/natsbus"
)

const (
	childEnv     = "SAGAFLOW_NATSSOAK_CHILD"
	repliesTopic = "soak.replies"
	paymentsCmds = "soak.payments"
	// ackWait is how long a member that stopped answering holds a message
	// before JetStream gives it to another.
	ackWait = time.Second
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// childConfig is what a participant process runs on.
type childConfig struct {
	NATS, DSN, Schema string
}

func TestMain(m *testing.M) {
	if raw := os.Getenv(childEnv); raw != "" {
		var c childConfig
		if err := json.Unmarshal([]byte(raw), &c); err != nil {
			os.Exit(3)
		}
		if err := runParticipant(c); err != nil {
			fmt.Fprintln(os.Stderr, "natssoak participant:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	pgtest.Main(m)
}

// runParticipant is the payment service: it consumes its commands over
// NATS, charges in its transaction (slowly, so that kills land mid-work),
// and replies through its outbox and relay, until it is killed.
func runParticipant(c childConfig) error {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, c.DSN)
	if err != nil {
		return err
	}
	nc, err := nats.Connect(c.NATS, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		return err
	}
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(2*time.Second))
	if err != nil {
		return err
	}
	w, err := natsbus.NewWriter(js, nil)
	if err != nil {
		return err
	}
	r, err := relay.New(pool, w, &relay.Config{Schema: c.Schema, PollInterval: 50 * time.Millisecond, Logger: quiet})
	if err != nil {
		return err
	}
	if err := r.Start(ctx); err != nil {
		return err
	}
	p, err := participant.New(pool, &participant.Config{Consumer: "payments", Schema: c.Schema, Logger: quiet, ReplyTopics: []string{repliesTopic}})
	if err != nil {
		return err
	}
	charges := pgx.Identifier{c.Schema, "charges"}.Sanitize()
	attempts := pgx.Identifier{c.Schema, "attempts"}.Sanitize()
	if err := participant.Handle(p, "payments.charge", func(ctx context.Context, tx pgx.Tx, call participant.Call[order]) (struct{}, error) {
		// Outside the transaction, so that it stays when the process dies:
		// how often each command was taken up. The work then takes long
		// enough (200-400 ms) for the attacks to land in it.
		if _, err := pool.Exec(ctx, "INSERT INTO "+attempts+" (order_id) VALUES ($1)", call.Command.OrderID); err != nil {
			return struct{}{}, err
		}
		time.Sleep(time.Duration(200+rand.IntN(200)) * time.Millisecond)
		if declined(call.Command.OrderID) {
			// Refused, over NATS: the saga must see this refusal (it names
			// the command it answers), not time out.
			return struct{}{}, steps.Permanent(steps.WithCode(declinedCode, errors.New("the card was declined")))
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+charges+" (order_id) VALUES ($1)", call.Command.OrderID)
		return struct{}{}, err
	}); err != nil {
		return err
	}
	rd, err := natsbus.NewReader(js, "payments", []string{paymentsCmds}, &natsbus.ReaderOpts{AckWait: ackWait, PullWait: 200 * time.Millisecond})
	if err != nil {
		return err
	}
	cons, err := p.Inbox().NewConsumer(rd, &inbox.ConsumerConfig{Handlers: p.Handlers(), RetryMax: 200 * time.Millisecond})
	if err != nil {
		return err
	}
	return cons.Run(ctx)
}

type order struct {
	OrderID string `json:"order_id"`
}

// declinedCode is the refusal of every tenth order (see declined).
const declinedCode = "declined"

// declined reports whether the participant refuses order id: o-007, o-017, …
func declined(id string) bool { return strings.HasSuffix(id, "7") }

// child is one participant process.
type child struct{ cmd *exec.Cmd }

func startChild(t *testing.T, cfg childConfig) *child {
	t.Helper()
	raw, err := json.Marshal(cfg)
	require.NoError(t, err)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+string(raw))
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	return &child{cmd: cmd}
}

func (c *child) kill() {
	_ = c.cmd.Process.Signal(syscall.SIGKILL)
	_ = c.cmd.Wait()
}

// TestSoakKilledConsumersOverNATS starts sagas whose charge step is a remote
// call to a payment service over NATS JetStream, while that service's
// processes are SIGKILLed mid-work and SIGSTOPped past the ack wait (their
// messages are redelivered to the other member, and the stopped one resumes
// later and tries to finish what it held). Every saga must complete with
// exactly one charge: 0 lost, 0 doubled, 0 stuck.
func TestSoakKilledConsumersOverNATS(t *testing.T) {
	if _, err := natstest.Binary(); err != nil {
		t.Skip(err)
	}
	ctx := context.Background()
	srv := natstest.Start(t)
	nc, err := nats.Connect(srv.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(2*time.Second))
	require.NoError(t, err)
	require.NoError(t, natsbus.Setup(ctx, js, []string{repliesTopic, paymentsCmds}, &natsbus.SetupOpts{Partitions: 4}))

	migrated := func() (*pgxpool.Pool, string) {
		pool, schema := pgtest.NewSchema(t)
		_, err := migrations.Migrate(ctx, pool, schema)
		require.NoError(t, err)
		return pool, schema
	}
	payPool, paySchema := migrated()
	_, err = payPool.Exec(ctx, "CREATE TABLE "+pgx.Identifier{paySchema, "charges"}.Sanitize()+" (order_id text NOT NULL)")
	require.NoError(t, err)
	_, err = payPool.Exec(ctx, "CREATE TABLE "+pgx.Identifier{paySchema, "attempts"}.Sanitize()+" (order_id text NOT NULL)")
	require.NoError(t, err)
	ordPool, ordSchema := migrated()

	w, err := natsbus.NewWriter(js, nil)
	require.NoError(t, err)
	rel, err := relay.New(ordPool, w, &relay.Config{Schema: ordSchema, PollInterval: 50 * time.Millisecond, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, rel.Start(ctx))
	t.Cleanup(func() { _ = rel.Stop(context.Background()) })
	def := saga.Define("soak",
		saga.Step[order]{Name: "charge", Timeout: time.Minute, Remote: &saga.Remote[order]{Topic: paymentsCmds, Type: "payments.charge",
			Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) { return o, nil }}},
		saga.Step[order]{Name: "done", Action: func(context.Context, *saga.StepRun, *order) error { return nil }},
	)
	engine, err := saga.New(ordPool, &saga.Config{Schema: ordSchema, Workers: 2, Logger: quiet, RescueInterval: time.Second,
		Kafka: &saga.KafkaConfig{ReplyTopic: repliesTopic, NewReader: func(group string, topics []string) saga.KafkaReader {
			r, err := natsbus.NewReader(js, group, topics, &natsbus.ReaderOpts{AckWait: ackWait, PullWait: 200 * time.Millisecond})
			if err != nil {
				panic(err)
			}
			return r
		}}})
	require.NoError(t, err)
	require.NoError(t, engine.Register(def))
	require.NoError(t, engine.Start(ctx))
	t.Cleanup(func() { _ = engine.Stop(context.Background()) })

	cfg := childConfig{NATS: srv.URL(), DSN: payPool.Config().ConnString(), Schema: paySchema}
	var mu sync.Mutex
	members := []*child{startChild(t, cfg), startChild(t, cfg)}
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range members {
			_ = c.cmd.Process.Signal(syscall.SIGCONT)
			c.kill()
		}
	})

	// The load: 10 sagas a second for 15 seconds, while the attacks run.
	const sagas, perSecond = 150, 10
	ids := make([]uuid.UUID, 0, sagas)
	rng := rand.New(rand.NewPCG(1, 2))
	kills, stops := 0, 0
	attack := time.NewTicker(900 * time.Millisecond)
	defer attack.Stop()
	start := time.NewTicker(time.Second / perSecond)
	defer start.Stop()
	for len(ids) < sagas {
		select {
		case <-start.C:
			st, err := saga.Start(ctx, engine, def, order{OrderID: fmt.Sprintf("o-%03d", len(ids))}, nil)
			require.NoError(t, err)
			ids = append(ids, st.ID)
		case <-attack.C:
			mu.Lock()
			i := rng.IntN(len(members))
			if rng.IntN(3) == 0 {
				// Paused past the ack wait: its messages go to the other
				// member; resumed, it tries to finish what it held.
				c := members[i]
				_ = c.cmd.Process.Signal(syscall.SIGSTOP)
				stops++
				time.AfterFunc(ackWait+time.Duration(rng.IntN(1500))*time.Millisecond, func() {
					_ = c.cmd.Process.Signal(syscall.SIGCONT)
				})
			} else {
				members[i].kill()
				kills++
				members[i] = startChild(t, cfg)
			}
			mu.Unlock()
		}
	}

	// Every saga ends; each that is not declined has exactly one charge, and
	// each declined one ends compensated with the refusal, and no charge.
	deadline := time.Now().Add(90 * time.Second)
	stuck := ids
	for len(stuck) > 0 && time.Now().Before(deadline) {
		var left []uuid.UUID
		for _, id := range stuck {
			in, err := engine.Get(ctx, id)
			require.NoError(t, err)
			if !in.Status.Terminal() {
				left = append(left, id)
			}
		}
		stuck = left
		if len(stuck) > 0 {
			time.Sleep(200 * time.Millisecond)
		}
	}
	completed, refused, lost, doubled := 0, 0, 0, 0
	rows, err := payPool.Query(ctx, "SELECT order_id, count(*) FROM "+pgx.Identifier{paySchema, "charges"}.Sanitize()+" GROUP BY order_id")
	require.NoError(t, err)
	charges := map[string]int{}
	for rows.Next() {
		var o string
		var n int
		require.NoError(t, rows.Scan(&o, &n))
		charges[o] = n
	}
	require.NoError(t, rows.Err())
	for i, id := range ids {
		in, err := engine.Get(ctx, id)
		require.NoError(t, err)
		oid := fmt.Sprintf("o-%03d", i)
		if declined(oid) {
			// Its refusal came over NATS and was applied: a refusal the
			// engine dropped would have ended it in a reply timeout.
			require.Equal(t, saga.StatusCompensated, in.Status, oid)
			require.NotNil(t, in.LastError, oid)
			require.Equal(t, declinedCode, in.LastError.Code, oid)
			require.Zero(t, charges[oid], oid)
			refused++
			continue
		}
		if in.Status == saga.StatusCompleted {
			completed++
		}
		switch n := charges[oid]; {
		case n == 0:
			lost++
		case n > 1:
			doubled++
		}
	}
	var dead, redelivered int
	require.NoError(t, payPool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{paySchema, "dead_letters"}.Sanitize()).Scan(&dead))
	require.NoError(t, payPool.QueryRow(ctx, "SELECT count(*) FROM (SELECT order_id FROM "+pgx.Identifier{paySchema, "attempts"}.Sanitize()+
		" GROUP BY order_id HAVING count(*) > 1) r").Scan(&redelivered))
	var total int
	require.NoError(t, payPool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{paySchema, "attempts"}.Sanitize()).Scan(&total))
	t.Logf("nats soak: sagas=%d completed=%d refused=%d lost=%d doubled=%d stuck=%d dead_letters=%d commands_taken=%d redelivered=%d sigkill=%d sigstop=%d",
		len(ids), completed, refused, lost, doubled, len(stuck), dead, total, redelivered, kills, stops)
	require.Positive(t, redelivered, "no command was taken up twice: the attacks missed the work they aim at")
	require.Positive(t, kills, "the soak attacked nothing")
	require.Positive(t, stops)
	require.Zero(t, lost, "lost")
	require.Zero(t, doubled, "doubled")
	require.Empty(t, stuck, "stuck")
	require.Equal(t, 15, refused)
	require.Equal(t, len(ids)-refused, completed)
	require.Zero(t, dead)
}
