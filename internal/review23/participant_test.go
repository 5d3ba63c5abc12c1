package review23

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/transport/natsbus"
)

type order struct{ ID string }
type charge struct{ Order string }
type charged struct{ Ref string }

// A saga calls a participant over NATS; then every command on the bus is
// published again as an operator's replay outside the stream's
// deduplication window would (a fresh Nats-Msg-Id, the same
// sagaflow-message-id and step key). The participant's inbox runs each
// step's handler once, nothing is dead-lettered, and the sagas stay
// completed.
func TestNATSParticipantRunsAReplayedCommandOnce(t *testing.T) {
	t.Parallel()
	srv, js := natsServer(t)
	ctx := ctxFor(t, 80*time.Second)
	const cmdTopic, replyTopic = "rv.pay.commands", "sagaflow.commands.order.replies"
	require.NoError(t, natsbus.Setup(ctx, js, []string{cmdTopic, replyTopic}, &natsbus.SetupOpts{Partitions: 2}))
	dO, dP := newDB(t), newDB(t)

	// The payments service: a participant over NATS, its replies relayed.
	p, err := participant.New(dP.Pool, &participant.Config{Consumer: "payments", Schema: dP.Schema, Logger: quiet})
	require.NoError(t, err)
	var mu sync.Mutex
	calls := map[string]int{}
	require.NoError(t, participant.Handle(p, "pay.charge", func(ctx context.Context, tx pgx.Tx, c participant.Call[charge]) (charged, error) {
		mu.Lock()
		calls[c.Command.Order]++
		mu.Unlock()
		_, err := tx.Exec(ctx, "INSERT INTO "+dP.Table("fx")+" (consumer, msg_id, key, hdr, val, seq) VALUES ('payments', $1, $2, '', '', 0)",
			c.Key.String(), c.Command.Order)
		return charged{Ref: "r-" + c.Command.Order}, err
	}))
	_, jsP := natsConnect(t, srv)
	dP.runRelay(t, natsWriter(t, jsP))
	c, err := p.Inbox().NewConsumer(natsReader(t, jsP, "payments", []string{cmdTopic}, 2*time.Second),
		&inbox.ConsumerConfig{Handlers: p.Handlers(), RetryInitial: 20 * time.Millisecond})
	require.NoError(t, err)
	require.NoError(t, c.Start(context.Background()))
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_ = c.Stop(sctx)
	})

	// The orders service: an engine reading its replies over NATS.
	_, jsO := natsConnect(t, srv)
	dO.runRelay(t, natsWriter(t, jsO))
	cfg := dO.Config()
	cfg.Kafka = &saga.KafkaConfig{NewReader: func(group string, topics []string) saga.KafkaReader {
		r, err := natsbus.NewReader(jsO, group, topics, &natsbus.ReaderOpts{AckWait: 2 * time.Second, PullWait: 300 * time.Millisecond})
		if err != nil {
			panic(err)
		}
		return r
	}}
	def := saga.Define("order", saga.Step[order]{Name: "charge", Timeout: time.Minute, Remote: &saga.Remote[order]{
		Topic: cmdTopic, Type: "pay.charge",
		Command: func(_ context.Context, _ *saga.StepRun, s *order) (any, error) { return charge{Order: s.ID}, nil },
	}})
	e, _ := testkit.StartEngine(t, dO.Pool, cfg, def)
	var ids []uuid.UUID
	for i := range 4 {
		st, err := saga.Start(ctx, e, def, order{ID: "o" + string(rune('a'+i))}, nil)
		require.NoError(t, err)
		ids = append(ids, st.ID)
	}
	for _, id := range ids {
		require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, e, id).Status)
	}

	// The replay: every stored command again, with a fresh Nats-Msg-Id.
	nc, _ := natsConnect(t, srv)
	raw, err := jetstream.New(nc)
	require.NoError(t, err)
	stream, err := js.Stream(ctx, natsbus.StreamName(cmdTopic))
	require.NoError(t, err)
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 4, info.State.Msgs, "one command per saga on the bus")
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		stored, err := stream.GetMsg(ctx, seq)
		require.NoError(t, err)
		m := nats.NewMsg(stored.Subject)
		m.Data = stored.Data
		for k, v := range stored.Header {
			if !strings.HasPrefix(k, "Nats-") {
				m.Header[k] = v
			}
		}
		m.Header.Set("Nats-Msg-Id", "replay-"+uuid.NewString())
		_, err = raw.PublishMsg(ctx, m)
		require.NoError(t, err)
	}
	testkit.WaitFor(t, patience, "the participant's group acknowledged the replayed commands", func() bool {
		total := 0
		for p := range 2 {
			cons, err := js.Consumer(ctx, natsbus.StreamName(cmdTopic), natsbus.ConsumerName("payments", p))
			if err != nil {
				return false
			}
			ci, err := cons.Info(ctx)
			if err != nil {
				return false
			}
			total += int(ci.NumPending) + ci.NumAckPending
		}
		return total == 0
	})
	time.Sleep(500 * time.Millisecond) // let the replies of the copies reach the engine
	mu.Lock()
	for o, n := range calls {
		require.Equal(t, 1, n, "handler runs for order %s", o)
	}
	mu.Unlock()
	require.Len(t, calls, 4)
	require.Equal(t, 4, dP.countEffects(t, "payments"))
	require.Zero(t, dP.countDead(t, "payments"), "a replayed command is a duplicate, not poison")
	for _, id := range ids {
		in, err := e.Get(ctx, id)
		require.NoError(t, err)
		require.Equal(t, saga.StatusCompleted, in.Status)
		require.Equal(t, 1, testkit.Events(in, "step_completed", "charge"), "the step completed once: %v", testkit.Timeline(in))
	}
}
