package transporttest_test

import (
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/transport/transporttest"
)

func TestMain(m *testing.M) { transporttest.Main(m) }

// kafkaSession is the session timeout of the tests' group members: how
// long the group waits for a member that went silent.
const kafkaSession = time.Second

// The conformance suite over Kafka: kafka-go's writer and consumer-group
// reader on an in-process kfake cluster, one per case.
//
// kfake cannot be restarted (it keeps its log in memory, and a new cluster
// on the same port would start empty), so the broker-restart case is
// modelled as what clients see of a broker that crashed and came back: every
// connection of every writer and reader is cut, and new ones are refused
// for two seconds; the cluster keeps its log and the group's offsets, as a
// restarted broker would from its disk. It is not a real restart.
func TestConformance(t *testing.T) {
	t.Parallel()
	transporttest.Run(t, transporttest.Bus{
		Name:            "kafka",
		RedeliveryAfter: kafkaSession,
		Start: func(t *testing.T, net *transporttest.Network) transporttest.Broker {
			kc := kafkatest.New(t, kafkatest.GroupMinSessionTimeout(100*time.Millisecond))
			return &kafkaBroker{kc: kc, net: net}
		},
	})
}

type kafkaBroker struct {
	kc  *kafkatest.Cluster
	net *transporttest.Network
}

func (b *kafkaBroker) CreateTopic(t *testing.T, topic string, partitions int) {
	if err := b.kc.CreateTopic(topic, int32(partitions)); err != nil {
		t.Fatal(err)
	}
}

// NewWriter returns a writer set up as relay.NewKafkaWriter sets one up,
// dialing through link (NewKafkaWriter's dialer has no dial function).
func (b *kafkaBroker) NewWriter(t *testing.T, link *transporttest.Link) relay.Writer {
	tr := &kafka.Transport{Dial: link.DialContext, MetadataTTL: time.Second}
	t.Cleanup(tr.CloseIdleConnections)
	return &kafka.Writer{
		Addr: kafka.TCP(b.kc.Addrs()...), Balancer: &kafka.Hash{}, RequiredAcks: kafka.RequireAll,
		BatchTimeout: time.Millisecond, BatchSize: relay.WriterBatchSizeDefault, BatchBytes: relay.WriterBatchBytesDefault,
		MaxAttempts: 3, WriteBackoffMin: 50 * time.Millisecond, WriteBackoffMax: 200 * time.Millisecond,
		ReadTimeout: 3 * time.Second, WriteTimeout: 3 * time.Second, Transport: tr,
	}
}

func (b *kafkaBroker) NewReader(_ *testing.T, link *transporttest.Link, group string, topics []string) transporttest.Reader {
	return kafka.NewReader(kafka.ReaderConfig{
		Brokers:           b.kc.Addrs(),
		Dialer:            &kafka.Dialer{DialFunc: link.DialContext, Timeout: 3 * time.Second},
		GroupID:           group,
		GroupTopics:       topics,
		StartOffset:       kafka.FirstOffset,
		CommitInterval:    0,
		MinBytes:          1,
		MaxBytes:          1 << 20,
		MaxWait:           50 * time.Millisecond,
		SessionTimeout:    kafkaSession,
		RebalanceTimeout:  kafkaSession,
		HeartbeatInterval: 100 * time.Millisecond,
		JoinGroupBackoff:  100 * time.Millisecond,
		ReadBackoffMin:    20 * time.Millisecond,
		ReadBackoffMax:    200 * time.Millisecond,
		MaxAttempts:       10,
	})
}

// Restart cuts every client connection and refuses new ones for two
// seconds; see TestConformance.
func (b *kafkaBroker) Restart(*testing.T) { b.net.Cut(2 * time.Second) }
