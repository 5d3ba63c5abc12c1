package consume_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/consume"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func produce(t *testing.T, c *kafkatest.Cluster, topic string, n int) {
	t.Helper()
	w := &kafka.Writer{Addr: kafka.TCP(c.Addrs()...), Balancer: &kafka.Hash{}, BatchTimeout: 5 * time.Millisecond, RequiredAcks: kafka.RequireAll}
	defer w.Close()
	var msgs []kafka.Message
	for i := range n {
		msgs = append(msgs, kafka.Message{Topic: topic, Key: []byte("k"), Value: fmt.Appendf(nil, "%d", i)})
	}
	require.NoError(t, w.WriteMessages(t.Context(), msgs...))
}

func reader(c *kafkatest.Cluster, group, topic string) *kafka.Reader {
	return kafka.NewReader(kafka.ReaderConfig{Brokers: c.Addrs(), GroupID: group, GroupTopics: []string{topic},
		StartOffset: kafka.FirstOffset, MinBytes: 1, MaxBytes: 1 << 20, MaxWait: 50 * time.Millisecond, CommitInterval: 0})
}

// Against a real consumer group: messages are handled in order, each offset
// is committed only after its Handle returned true, and a message whose
// Handle gave up (false) is not committed, so the next member of the group
// gets it again, and nothing before it.
func TestLoopCommitsOnlyWhatItDealtWith(t *testing.T) {
	t.Parallel()
	c := kafkatest.New(t, kafkatest.SeedTopics(1, "jobs"))
	produce(t, c, "jobs", 6)

	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	var seen []string
	r := reader(c, "g", "jobs")
	loop := consume.Loop{Reader: r, Log: quiet, What: "test", Handle: func(_, _ context.Context, m kafka.Message) bool {
		seen = append(seen, string(m.Value))
		if string(m.Value) == "3" {
			cancel() // give up on 3, as a stopping worker does
			return false
		}
		return true
	}}
	loop.Run(ctx, ctx)
	require.NoError(t, r.Close())
	require.Equal(t, []string{"0", "1", "2", "3"}, seen)

	// The next member starts at 3: 0..2 were committed, 3 was not.
	ctx2, cancel2 := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel2()
	seen = nil
	r2 := reader(c, "g", "jobs")
	defer r2.Close()
	loop2 := consume.Loop{Reader: r2, Log: quiet, What: "test", Handle: func(_, _ context.Context, m kafka.Message) bool {
		seen = append(seen, string(m.Value))
		if len(seen) == 3 {
			cancel2()
		}
		return true
	}}
	loop2.Run(ctx2, ctx2)
	require.Equal(t, []string{"3", "4", "5"}, seen)
}

// flaky fails its first fetches, then reads from the real reader: the seam
// the loop's fetch retry is tested through.
type flaky struct {
	consume.Reader
	fails atomic.Int32
}

func (f *flaky) FetchMessage(ctx context.Context) (kafka.Message, error) {
	if f.fails.Add(-1) >= 0 {
		return kafka.Message{}, errors.New("broker gone")
	}
	return f.Reader.FetchMessage(ctx)
}

// A failed fetch is retried with backoff and loses nothing; a stopped fetch
// context ends the loop without error.
func TestLoopRetriesAFailedFetch(t *testing.T) {
	t.Parallel()
	c := kafkatest.New(t, kafkatest.SeedTopics(1, "jobs"))
	produce(t, c, "jobs", 2)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	r := reader(c, "g", "jobs")
	defer r.Close()
	f := &flaky{Reader: r}
	f.fails.Store(3)
	var mu sync.Mutex
	var seen []string
	loop := consume.Loop{Reader: f, Log: quiet, What: "test", Handle: func(_, _ context.Context, m kafka.Message) bool {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, string(m.Value))
		if len(seen) == 2 {
			cancel()
		}
		return true
	}}
	loop.Run(ctx, ctx)
	require.Equal(t, []string{"0", "1"}, seen)
	require.Less(t, f.fails.Load(), int32(0), "the failing fetches were made")
}

// A batch tops up with what a real kafka-go reader holds ready, judged by
// its Stats().QueueLength, and stops at once when Queued reports nothing
// ready: then every batch is the one message fetched.
func TestLoopTopsUpOnlyWhatIsQueued(t *testing.T) {
	t.Parallel()
	const n = 60
	run := func(t *testing.T, queued func(*kafka.Reader) func() int) (sizes []int, seen []string) {
		c := kafkatest.New(t, kafkatest.SeedTopics(1, "jobs"))
		produce(t, c, "jobs", n)
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		r := reader(c, "g", "jobs")
		defer r.Close()
		loop := consume.Loop{Reader: r, Log: quiet, What: "test", MaxBatch: 16, Queued: queued(r),
			HandleBatch: func(_, _ context.Context, ms []kafka.Message) int {
				sizes = append(sizes, len(ms))
				for _, m := range ms {
					seen = append(seen, string(m.Value))
				}
				if len(seen) == n {
					cancel()
				}
				return len(ms)
			}}
		loop.Run(ctx, ctx)
		return sizes, seen
	}
	var want []string
	for i := range n {
		want = append(want, fmt.Sprint(i))
	}

	sizes, seen := run(t, func(r *kafka.Reader) func() int { return func() int { return int(r.Stats().QueueLength) } })
	require.Equal(t, want, seen)
	require.Greater(t, slices.Max(sizes), 1, "the reader's queue fills batches: %v", sizes)

	sizes, seen = run(t, func(*kafka.Reader) func() int { return func() int { return 0 } })
	require.Equal(t, want, seen)
	require.Equal(t, 1, slices.Max(sizes), "nothing queued, no top-up: %v", sizes)
}
