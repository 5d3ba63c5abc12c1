package relay_test

import (
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/wire"
)

func TestJavaPartitionerPlacesKeysAsTheJavaClient(t *testing.T) {
	t.Parallel()
	b := &relay.JavaPartitioner{}
	partitions := func(n int) []int {
		out := make([]int, n)
		for i := range out {
			out[i] = i
		}
		return out
	}
	// toPositive(murmur2("21")) = 1173551340, from the Java client's own
	// test vector (UtilsTest.testMurmur2).
	require.Equal(t, 40, b.Balance(kafka.Message{Key: []byte("21")}, partitions(100)...))
	for i := range 200 {
		key := []byte(uuid.NewString())
		n := 1 + i%17
		require.Equal(t, wire.Partition(key, n), b.Balance(kafka.Message{Key: key}, partitions(n)...))
		// kafka-go's own port of the Java partitioner agrees.
		require.Equal(t, kafka.Murmur2Balancer{}.Balance(kafka.Message{Key: key}, partitions(n)...),
			b.Balance(kafka.Message{Key: key}, partitions(n)...))
	}
	seen := map[int]bool{}
	for range 6 {
		seen[b.Balance(kafka.Message{}, partitions(3)...)] = true
	}
	require.Len(t, seen, 3, "messages without a key go round robin")
}

// TestRelayWithJavaPartitionerCoPartitionsWithAnotherClient: rows the relay
// publishes with JavaPartitioner land on the partitions franz-go's default
// (Java-compatible) partitioner picks for the same keys: a saga's messages
// stay in one partition whichever client wrote them.
func TestRelayWithJavaPartitionerCoPartitionsWithAnotherClient(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const topic = "copartitioned"
	require.NoError(t, e.kc.CreateTopic(topic, 7))
	cl, err := kgo.NewClient(kgo.SeedBrokers(e.kc.Addrs()...))
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	keys := make([]string, 40)
	for i := range keys {
		keys[i] = uuid.NewString()
		e.insert(t, topic, keys[i], i)
		require.NoError(t, cl.ProduceSync(e.ctx, &kgo.Record{Topic: topic, Key: []byte(keys[i]), Value: []byte("java")}).FirstErr())
	}
	w := relay.NewKafkaWriter(e.kc.Addrs(), &relay.WriterOpts{Balancer: &relay.JavaPartitioner{}, MaxAttempts: 1})
	t.Cleanup(func() { require.NoError(t, w.Close()) })
	published, _ := drain(t, e.ctx, e.relay(t, w, relay.Config{}))
	require.Equal(t, len(keys), published)

	byKey := map[string][]int{}
	for _, m := range e.read(t, topic) {
		byKey[string(m.Key)] = append(byKey[string(m.Key)], m.Partition)
	}
	used := map[int]bool{}
	for _, k := range keys {
		require.Len(t, byKey[k], 2, "key %s", k)
		require.Equal(t, byKey[k][0], byKey[k][1], "key %s: the relay's copy and franz-go's share a partition", k)
		require.Equal(t, wire.Partition([]byte(k), 7), byKey[k][0], fmt.Sprintf("key %s", k))
		used[byKey[k][0]] = true
	}
	require.Greater(t, len(used), 3, "the keys spread over the partitions")
}
