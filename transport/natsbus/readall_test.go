package natsbus_test

import (
	"testing"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/transport/natsbus"
)

// ReadAll returns what a topic holds, in stream order, with the partition
// and sequence a Reader would give, and acknowledges nothing.
func TestReadAll(t *testing.T) {
	t.Parallel()
	_, js := server(t)
	ctx := ctxT(t)
	require.NoError(t, natsbus.Setup(ctx, js, []string{"readall"}, &natsbus.SetupOpts{Partitions: 3}))
	got, err := natsbus.ReadAll(ctx, js, "readall")
	require.NoError(t, err)
	require.Empty(t, got)
	w, err := natsbus.NewWriter(js, nil)
	require.NoError(t, err)
	var msgs []kafka.Message
	for i, k := range []string{"a", "b", "c", "a"} {
		msgs = append(msgs, kafka.Message{Topic: "readall", Key: []byte(k), Value: []byte{byte('0' + i)},
			Headers: []kafka.Header{{Key: "sagaflow-message-id", Value: []byte("m-" + string(rune('0'+i)))}}})
	}
	require.NoError(t, w.WriteMessages(ctx, msgs...))
	got, err = natsbus.ReadAll(ctx, js, "readall")
	require.NoError(t, err)
	require.Len(t, got, 4)
	for i, m := range got {
		require.Equal(t, "readall", m.Topic)
		require.Equal(t, int64(i+1), m.Offset, "stream order")
		require.GreaterOrEqual(t, m.Partition, 0)
	}
	require.Equal(t, got[0].Partition, got[3].Partition, "one key, one partition")
	again, err := natsbus.ReadAll(ctx, js, "readall")
	require.NoError(t, err)
	require.Len(t, again, 4, "nothing was consumed")
}
