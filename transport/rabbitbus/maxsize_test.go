package rabbitbus_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/transport/rabbitbus"
)

// A broker whose max_message_size is smaller than the writer's
// MaxMessageBytes closes the channel when it gets a larger message. The
// writer parks that message as too large, and the others of the batch wait
// for the next write (no attempt spent): nothing is lost and the batch is
// not held back for good.
func TestWriterBrokerSizeLimitParksTheMessage(t *testing.T) {
	t.Parallel()
	n := startNode(t, "max_message_size = 4096")
	dial := rabbitbus.Dial(n.url())
	conn, err := dial()
	require.NoError(t, err)
	defer conn.Close()
	topo := rabbitbus.Topology{Partitions: 1}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, rabbitbus.Setup(ctx, conn, []string{"t"}, &rabbitbus.SetupOpts{Topology: topo, Groups: []string{"g"}}))
	w, err := rabbitbus.NewWriter(dial, &rabbitbus.WriterOpts{Topology: topo})
	require.NoError(t, err)
	defer w.Close()

	msgs := []kafka.Message{
		{Topic: "t", Value: []byte("small-1")},
		{Topic: "t", Value: bytes.Repeat([]byte("x"), 8000)},
		{Topic: "t", Value: []byte("small-2")},
	}
	pes := publishErrors(t, w.WriteMessages(ctx, msgs...), len(msgs))
	require.NotNil(t, pes[1])
	require.True(t, pes[1].Permanent, "%v", pes[1])
	require.Equal(t, relay.CodeTooLarge, pes[1].Code)
	for _, i := range []int{0, 2} {
		if pes[i] != nil {
			require.True(t, pes[i].Outage, "message %d: not its fault: %v", i, pes[i])
		}
	}
	// The next write, on a new channel, carries the small ones.
	require.NoError(t, w.WriteMessages(ctx, msgs[0], msgs[2]))
}
