package natsbus_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/sagaflow/sagaflow/internal/natstest"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/transport/natsbus"
	"github.com/sagaflow/sagaflow/transport/transporttest"
)

func TestMain(m *testing.M) { transporttest.Main(m) }

// testAckWait is the ack wait of the tests' consumers: short, so that
// redelivery cases stay quick.
const testAckWait = time.Second

// The conformance suite over JetStream: each case gets a throwaway
// nats-server of its own (file storage in a temporary directory), which
// its broker-restart case kills (SIGKILL) and starts again on the same
// port and store directory. The machine's own server is never touched.
func TestConformance(t *testing.T) {
	t.Parallel()
	transporttest.Run(t, transporttest.Bus{
		Name:            "nats",
		RedeliveryAfter: testAckWait,
		Start: func(t *testing.T, _ *transporttest.Network) transporttest.Broker {
			return &broker{srv: natstest.Start(t)}
		},
	})
}

type broker struct{ srv *natstest.Server }

// connect opens a connection through link that reconnects quickly and
// forever, closed when the test ends.
func (b *broker) connect(t *testing.T, link *transporttest.Link) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(b.srv.URL(), nats.SetCustomDialer(link), nats.MaxReconnects(-1),
		nats.ReconnectWait(50*time.Millisecond), nats.Timeout(2*time.Second))
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	return js
}

func (b *broker) CreateTopic(t *testing.T, topic string, partitions int) {
	js := b.connect(t, transporttest.NewNetwork().Link())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{Partitions: partitions}); err != nil {
		t.Fatal(err)
	}
}

func (b *broker) NewWriter(t *testing.T, link *transporttest.Link) relay.Writer {
	w, err := natsbus.NewWriter(b.connect(t, link), nil)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func (b *broker) NewReader(t *testing.T, link *transporttest.Link, group string, topics []string) transporttest.Reader {
	r, err := natsbus.NewReader(b.connect(t, link), group, topics,
		&natsbus.ReaderOpts{AckWait: testAckWait, PullWait: 500 * time.Millisecond, AckTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (b *broker) Restart(t *testing.T) { b.srv.Restart(t) }
