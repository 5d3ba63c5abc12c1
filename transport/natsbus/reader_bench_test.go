package natsbus_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/transport/natsbus"
	"github.com/sagaflow/sagaflow/wire"
)

// BenchmarkReaderDrainsInBatches fills a topic of 8 partitions with b.N
// messages (run it with -benchtime=4000x or more), untimed, then drains them
// as a consume loop does: one message fetched, topped up with what is ready
// (each waited for at most 200 µs) to at most 16, then the batch committed
// with one CommitMessages call. It reports msgs/s. A partition's next
// message comes only once the one before it is acknowledged (MaxAckPending
// 1), so the time a commit takes is time every partition of the batch
// waits.
func BenchmarkReaderDrainsInBatches(b *testing.B) {
	_, js := server(b)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	b.Cleanup(cancel)
	const topic = "bench.drain"
	require.NoError(b, natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{Partitions: 8}))
	w, err := natsbus.NewWriter(js, nil)
	require.NoError(b, err)
	n := b.N
	for start := 0; start < n; start += 500 {
		var ms []kafka.Message
		for i := start; i < min(start+500, n); i++ {
			ms = append(ms, kafka.Message{Topic: topic, Key: fmt.Appendf(nil, "order-%d", i%1000), Value: []byte(`{"x":1}`),
				Headers: []kafka.Header{{Key: wire.HeaderMessageID, Value: fmt.Appendf(nil, "m-%d", i)}}})
		}
		require.NoError(b, w.WriteMessages(ctx, ms...))
	}
	r, err := natsbus.NewReader(js, "bench", []string{topic}, &natsbus.ReaderOpts{PullWait: 100 * time.Millisecond})
	require.NoError(b, err)
	defer r.Close()

	b.ResetTimer()
	start := time.Now()
	batches := 0
	for got := 0; got < n; batches++ {
		m, err := r.FetchMessage(ctx)
		require.NoError(b, err)
		ms := []kafka.Message{m}
		for len(ms) < 16 {
			tctx, tcancel := context.WithTimeout(ctx, 200*time.Microsecond)
			m, err := r.FetchMessage(tctx)
			tcancel()
			if err != nil {
				break
			}
			ms = append(ms, m)
		}
		require.NoError(b, r.CommitMessages(ctx, ms...))
		got += len(ms)
	}
	d := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(n)/d.Seconds(), "msgs/s")
	b.ReportMetric(float64(n)/float64(batches), "msgs/batch")
}
