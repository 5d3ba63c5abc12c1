// Package consume is sagaflow's one Kafka consume loop: fetch a message,
// deal with it until done, and only then commit its offset. The engine's
// Kafka mode, participants and inbox consumers all run on it; what "deal
// with" means (run a step, process through the inbox, retry, hold or
// dead-letter) is the caller's Handle.
package consume

import (
	"context"
	"log/slog"

	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/lifecycle"
)

// Reader is what a loop reads from: *kafka.Reader, in a consumer group,
// satisfies it.
type Reader interface {
	FetchMessage(ctx context.Context) (kafka.Message, error)
	CommitMessages(ctx context.Context, msgs ...kafka.Message) error
}

// Loop consumes one reader.
type Loop struct {
	Reader Reader
	Log    *slog.Logger
	// What prefixes the log lines, e.g. "sagaflow inbox".
	What string
	// Attrs go with every log line, e.g. the consumer's name.
	Attrs []any
	// Handle deals with m until it is done with it (processed, skipped,
	// held elsewhere or dead-lettered), retrying as it sees fit, and
	// reports true; or reports false when it gave up because a context
	// ended, which leaves the offset uncommitted, so the message is
	// redelivered to whoever takes the partition.
	Handle func(fetch, work context.Context, m kafka.Message) bool
	// CommitLost says, for the log, what a lost offset commit means: the
	// message comes again and the caller's deduplication skips it.
	CommitLost string
}

// Run consumes until fetch ends (stop fetching) or work ends (stop at
// once). A failed fetch is retried with backoff. Offsets are committed one
// message at a time, after Handle, in order, so a partition's order is
// kept and nothing is committed that was not dealt with.
func (l *Loop) Run(fetch, work context.Context) {
	failures := 0
	for fetch.Err() == nil {
		m, err := l.Reader.FetchMessage(fetch)
		if fetch.Err() != nil {
			return
		}
		if err != nil {
			failures++
			l.Log.WarnContext(work, l.What+": fetch failed", append(l.Attrs, slog.Any("error", err))...)
			if !lifecycle.Sleep(fetch, lifecycle.Backoff(failures)) {
				return
			}
			continue
		}
		failures = 0
		if !l.Handle(fetch, work, m) {
			return
		}
		if err := l.Reader.CommitMessages(work, m); err != nil && work.Err() == nil {
			l.Log.WarnContext(work, l.What+": commit offset failed; "+l.CommitLost,
				append(l.Attrs, slog.String("topic", m.Topic), slog.Int("partition", m.Partition),
					slog.Int64("offset", m.Offset), slog.Any("error", err))...)
		}
	}
}
