package natsbus_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/transport/natsbus"
	"github.com/sagaflow/sagaflow/wire"
)

// TestAcknowledgedMessagesSurviveServerKills publishes without pause while
// the server is killed (SIGKILL) and started again on its store, five
// times, and then reads every stream by sequence: each message the writer
// reported acknowledged must be there, since the relay marks its row
// published on that report and never sends it again.
func TestAcknowledgedMessagesSurviveServerKills(t *testing.T) {
	t.Parallel()
	srv, js := server(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	topics := []string{"kill.a", "kill.b"}
	require.NoError(t, natsbus.Setup(ctx, js, topics, &natsbus.SetupOpts{Partitions: 4}))
	w, err := natsbus.NewWriter(js, &natsbus.WriterOpts{MetadataTTL: time.Hour})
	require.NoError(t, err)

	var mu sync.Mutex
	acked := map[string]bool{}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for n := 0; ; n++ {
			select {
			case <-stop:
				return
			default:
			}
			msgs := make([]kafka.Message, 20)
			for i := range msgs {
				id := fmt.Sprintf("m-%d-%d", n, i)
				msgs[i] = kafka.Message{Topic: topics[i%2], Key: []byte(fmt.Sprintf("k-%d", i)), Value: []byte(id),
					Headers: []kafka.Header{{Key: wire.HeaderMessageID, Value: []byte(id)}}}
			}
			wctx, wcancel := context.WithTimeout(ctx, time.Second)
			err := w.WriteMessages(wctx, msgs...)
			wcancel()
			var werrs kafka.WriteErrors
			if err != nil && !errors.As(err, &werrs) {
				continue // nothing acknowledged
			}
			mu.Lock()
			for i := range msgs {
				if err == nil || werrs[i] == nil {
					acked[string(msgs[i].Value)] = true
				}
			}
			mu.Unlock()
		}
	}()
	for range 5 {
		time.Sleep(400 * time.Millisecond)
		srv.Kill()
		time.Sleep(300 * time.Millisecond)
		require.NoError(t, srv.StartAgain())
	}
	time.Sleep(time.Second)
	close(stop)
	<-done

	stored := map[string]bool{}
	for _, topic := range topics {
		var s jetstream.Stream
		require.Eventually(t, func() bool { s, err = js.Stream(ctx, natsbus.StreamName(topic)); return err == nil },
			10*time.Second, 50*time.Millisecond, "stream of %s after the restarts: %v", topic, err)
		info, err := s.Info(ctx)
		require.NoError(t, err)
		t.Logf("%s: msgs=%d first=%d last=%d deleted=%d lost=%v", topic, info.State.Msgs, info.State.FirstSeq,
			info.State.LastSeq, info.State.NumDeleted, info.State.Lost)
		for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
			m, err := s.GetMsg(ctx, seq)
			if errors.Is(err, jetstream.ErrMsgNotFound) {
				continue
			}
			require.NoError(t, err, "seq %d", seq)
			stored[string(m.Data)] = true
		}
	}
	mu.Lock()
	defer mu.Unlock()
	require.Greater(t, len(acked), 100, "the writer got few acknowledgements; the test proves little")
	var missing []string
	for id := range acked {
		if !stored[id] {
			missing = append(missing, id)
		}
	}
	require.Empty(t, missing, "%d of %d acknowledged messages are not in the streams", len(missing), len(acked))
	t.Logf("%d acknowledged messages, all stored (%d stored in all)", len(acked), len(stored))
}
