package rabbitbus_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/transport/rabbitbus"
	"github.com/sagaflow/sagaflow/transport/transporttest"
)

// testHeartbeat is the heartbeat of the conformance suite's connections:
// the broker closes a silent connection after about two of them, and
// delivers what its consumer had not acknowledged to the next consumer.
const testHeartbeat = time.Second

// The conformance suite over RabbitMQ.
//
// Every case but the broker restart runs on the machine's RabbitMQ (see
// broker), with an exchange and queues of its own that it deletes. The
// broker-restart case gets a throwaway RabbitMQ node of its own (its own
// name, ports and data directory; about 5 s to boot here), which it stops
// (SIGTERM, a clean shutdown) and starts again on the same data: a real
// restart, never of the shared broker. Without the RabbitMQ server
// binaries that case is skipped.
//
// Not SIGKILL: on RabbitMQ 3.10 a node killed soon after it declared a
// quorum queue can come back without that queue's Raft member (its
// registry is written to disk lazily): the queue exists, has no leader,
// and takes no messages ("leader not known" in the node's log; seen here
// with queues declared a second before the kill). The writer reports
// that as an outage (no confirm), so the relay waits without losing
// anything, but the queue must be deleted and declared again by an
// operator.
//
// The ack-wait case freezes a reader's connection: RabbitMQ notices the
// silent connection through missed heartbeats (testHeartbeat), closes it,
// and gives its unacknowledged message to the next consumer. (RabbitMQ's
// own ack wait, consumer_timeout, is for a consumer whose connection is
// alive; it is 30 minutes by default; see the package documentation.)
func TestConformance(t *testing.T) {
	t.Parallel()
	url := broker(t)
	transporttest.Run(t, transporttest.Bus{
		Name:            "rabbitmq",
		RedeliveryAfter: 3 * testHeartbeat,
		Start: func(t *testing.T, _ *transporttest.Network) transporttest.Broker {
			b := &conformanceBroker{url: url}
			if strings.HasSuffix(t.Name(), "/BrokerRestart") {
				b.node = startNode(t, "")
				b.url = b.node.url()
			}
			b.id = randomID()
			b.exchange = "sf-conf-" + b.id
			t.Cleanup(func() { b.cleanup(t) })
			return b
		},
	})
}

type conformanceBroker struct {
	url      string
	node     *node // nil: the shared broker
	id       string
	exchange string

	mu         sync.Mutex
	partitions int
	queues     []string
}

func (b *conformanceBroker) topo() rabbitbus.Topology {
	b.mu.Lock()
	defer b.mu.Unlock()
	return rabbitbus.Topology{Exchange: b.exchange, Partitions: b.partitions}
}

// dial connects through link with short heartbeats.
func (b *conformanceBroker) dial(link *transporttest.Link) rabbitbus.DialFunc {
	return func() (*amqp.Connection, error) {
		return amqp.DialConfig(b.url, amqp.Config{Heartbeat: testHeartbeat, Locale: "en_US", Dial: link.Dial})
	}
}

// CreateTopic records the topic's partitions: the case's writers and
// readers use them. The queues are per group: NewReader declares them.
func (b *conformanceBroker) CreateTopic(t *testing.T, topic string, partitions int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.partitions != 0 && b.partitions != partitions {
		t.Fatalf("rabbitbus conformance: one partition count per case (%d, then %d for %s)", b.partitions, partitions, topic)
	}
	b.partitions = partitions
}

func (b *conformanceBroker) NewWriter(t *testing.T, link *transporttest.Link) relay.Writer {
	w, err := rabbitbus.NewWriter(b.dial(link), &rabbitbus.WriterOpts{Topology: b.topo()})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func (b *conformanceBroker) NewReader(t *testing.T, link *transporttest.Link, group string, topics []string) transporttest.Reader {
	topo := b.topo()
	group = "sf-conf-" + b.id + "-" + group // queues are per vhost: the case's own
	b.mu.Lock()
	for _, tp := range topics {
		for p := range max(topo.Partitions, rabbitbus.PartitionsDefault) {
			b.queues = append(b.queues, rabbitbus.QueueName(group, tp, p))
		}
	}
	b.mu.Unlock()
	// Declared before NewReader returns, as a deployment runs Setup before
	// anything is published: a message published while its partition has
	// no queue comes back to the relay and is retried, and a retried row
	// can be overtaken by a later one of its key (see package relay), which
	// the per-key order cases would see.
	conn, err := rabbitbus.Dial(b.url)()
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := rabbitbus.Setup(ctx, conn, topics, &rabbitbus.SetupOpts{Topology: topo, Groups: []string{group}}); err != nil {
		t.Fatal(err)
	}
	r, err := rabbitbus.NewReader(b.dial(link), group, topics, &rabbitbus.ReaderOpts{Topology: topo})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// Restart stops the case's own node cleanly and starts it again on its
// data.
func (b *conformanceBroker) Restart(t *testing.T) {
	if b.node == nil {
		t.Fatal("rabbitbus conformance: only the broker-restart case has a node of its own to restart")
	}
	if err := b.node.restart(false); err != nil {
		t.Fatal(err)
	}
}

// cleanup deletes the case's queues and exchange from the shared broker.
func (b *conformanceBroker) cleanup(t *testing.T) {
	if b.node != nil {
		return // its data goes with its directory
	}
	conn, err := rabbitbus.Dial(b.url)()
	if err != nil {
		t.Logf("clean up: %v", err)
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, q := range b.queues {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			if ch, err = conn.Channel(); err != nil {
				return
			}
		}
	}
	_ = ch.ExchangeDelete(b.exchange, false, false)
}
