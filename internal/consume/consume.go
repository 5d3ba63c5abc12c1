// Package consume is sagaflow's one Kafka consume loop: fetch a message,
// deal with it until done, and only then commit its offset. The engine's
// Kafka mode, participants and inbox consumers all run on it; what "deal
// with" means (run a step, process through the inbox, retry, hold or
// dead-letter) is the caller's Handle.
package consume

import (
	"context"
	"errors"
	"log/slog"
	"time"

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
	// HandleBatch, when set with MaxBatch > 1, is used instead of Handle:
	// it is given, in order, the message fetched and up to MaxBatch-1 more
	// that the reader has ready at once (each waited for at most
	// batchTopUp), deals with them, and reports how many of them, from the
	// first, it dealt with before a context ended; those offsets are
	// committed, and the rest are handed to it first by the next Run.
	HandleBatch func(fetch, work context.Context, ms []kafka.Message) int
	MaxBatch    int
	// Queued, when set, reports how many messages the reader holds ready.
	// It is asked once per batch, after the batch's first message: the
	// batch tops up with at most that many, and with none when it reports
	// none, instead of waiting batchTopUp for a message that is not there. For a *kafka.Reader it
	// is Stats().QueueLength, which also resets the reader's other stats,
	// so it is set only for readers no one else reads the stats of.
	Queued func() int
	// OnFetch, when set, is told the outcome of each fetch of a message
	// that was not cut short by fetch's end: nil when a message came, else
	// the error (a health check shows it).
	OnFetch func(err error)

	// pending are messages Handle gave up on: the reader has moved past
	// them, so the next Run on the same reader handles them before
	// fetching (committing a later offset first would skip them for good).
	pending []kafka.Message
}

// batchTopUp is how long a batch waits for each message after its first:
// long enough to take what the reader has buffered, too short to hold the
// first message back much. (An idle Go program sleeps in whole
// milliseconds, so a wait this short can take up to one; see Loop.Queued.)
const batchTopUp = 200 * time.Microsecond

// Run consumes until fetch ends (stop fetching) or work ends (stop at
// once). A failed fetch is retried with backoff. Offsets are committed
// after Handle (or HandleBatch) dealt with their messages, in order, so a
// partition's order is kept and nothing is committed that was not dealt
// with. A message Handle gave up on is handled first by the next Run of
// the same Loop. Run is not safe for concurrent use.
func (l *Loop) Run(fetch, work context.Context) {
	failures := 0
	for fetch.Err() == nil {
		var ms []kafka.Message
		if len(l.pending) > 0 {
			ms, l.pending = l.pending, nil
		} else {
			m, err := l.Reader.FetchMessage(fetch)
			if fetch.Err() != nil {
				if err == nil {
					l.pending = []kafka.Message{m} // fetched and not dealt with
				}
				return
			}
			if l.OnFetch != nil {
				l.OnFetch(err)
			}
			if err != nil {
				failures++
				l.fetchFailed(work, err)
				if !lifecycle.Sleep(fetch, lifecycle.Backoff(failures)) {
					return
				}
				continue
			}
			ms = []kafka.Message{m}
		}
		failures = 0
		batching := l.HandleBatch != nil && l.MaxBatch > 1
		// How many more messages to top up with: what Queued reports ready,
		// asked once per batch (-1 without Queued: until a wait times out).
		ready := -1
		if batching && l.Queued != nil {
			ready = l.Queued()
		}
		for batching && len(ms) < l.MaxBatch && ready != 0 {
			if ready > 0 {
				ready--
			}
			// Only what the reader holds already: a cancelled fetch takes
			// nothing from it.
			ctx, cancel := context.WithTimeout(fetch, batchTopUp)
			m, err := l.Reader.FetchMessage(ctx)
			timedOut := ctx.Err() != nil
			cancel()
			if err != nil {
				if !timedOut {
					l.Log.WarnContext(work, l.What+": fetch failed", append(l.Attrs, slog.Any("error", err))...)
				}
				break
			}
			ms = append(ms, m)
		}
		if fetch.Err() != nil {
			l.pending = ms
			return
		}
		done := 0
		if batching {
			done = l.HandleBatch(fetch, work, ms)
		} else {
			for done < len(ms) && l.Handle(fetch, work, ms[done]) {
				done++
			}
		}
		if done > 0 {
			if err := l.Reader.CommitMessages(work, ms[:done]...); err != nil && work.Err() == nil {
				last := ms[done-1]
				l.Log.WarnContext(work, l.What+": commit offset failed; "+l.CommitLost,
					append(l.Attrs, slog.String("topic", last.Topic), slog.Int("partition", last.Partition),
						slog.Int64("offset", last.Offset), slog.Int("messages", done), slog.Any("error", err))...)
			}
		}
		if done < len(ms) {
			l.pending = ms[done:]
			return
		}
	}
}

// fetchFailed logs a failed fetch: a warning, as the fetch is tried again;
// an error when the broker refuses the group's session timeout, which no
// retry mends (the consumer never joins its group, and consumes nothing).
func (l *Loop) fetchFailed(work context.Context, err error) {
	if errors.Is(err, kafka.InvalidSessionTimeout) {
		l.Log.ErrorContext(work, l.What+": the broker refuses the consumer group's session timeout, so nothing is consumed: "+
			"set it within the broker's group.min.session.timeout.ms and group.max.session.timeout.ms (6 s and 30 min by default)",
			append(l.Attrs, slog.Any("error", err))...)
		return
	}
	l.Log.WarnContext(work, l.What+": fetch failed", append(l.Attrs, slog.Any("error", err))...)
}
