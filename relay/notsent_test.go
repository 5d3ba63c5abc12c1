package relay_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/relay"
)

// scriptWriter answers each message by its payload's verdict: a function of
// the message, nil for accepted.
type scriptWriter struct {
	mu      sync.Mutex
	verdict func(m kafka.Message) error
	sent    []string
}

func (w *scriptWriter) WriteMessages(_ context.Context, msgs ...kafka.Message) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	errs := make(kafka.WriteErrors, len(msgs))
	failed := false
	for i, m := range msgs {
		if errs[i] = w.verdict(m); errs[i] != nil {
			failed = true
		} else {
			w.sent = append(w.sent, string(m.Value))
		}
	}
	if failed {
		return errs
	}
	return nil
}

func (w *scriptWriter) Close() error { return nil }

// A writer that holds back a key's later messages behind a failed one
// (relay.PublishError.NotSent): they spend no attempt and are not parked
// with it, and are due again with it (a retry) or at once (it was parked).
// A NotSent message whose key had no failure in the write is a plain
// failure: an attempt spent, so that a writer that says it wrongly cannot
// make a row spin.
func TestMessagesNotSentBehindAFailureKeepTheirAttempts(t *testing.T) {
	t.Parallel()
	e := setup(t)
	notSent := &relay.PublishError{NotSent: true, Err: errors.New("not sent: an earlier message of its key failed")}
	w := &scriptWriter{verdict: func(m kafka.Message) error {
		switch string(m.Key) {
		case "retried":
			if string(m.Value) == `{"seq":0}` {
				return errors.New("endpoint answered 503")
			}
			return notSent
		case "parked":
			if string(m.Value) == `{"seq":0}` {
				return &relay.PublishError{Permanent: true, Code: "http_410", Err: errors.New("gone")}
			}
			return notSent
		case "alone":
			return notSent
		}
		return nil
	}}
	backoff := func(int) time.Duration { return time.Hour }
	r := e.relay(t, w, relay.Config{BatchSize: 20, MaxAttempts: 2, Backoff: backoff})
	retried := []uuid.UUID{e.insert(t, topicOrders, "retried", 0), e.insert(t, topicOrders, "retried", 1), e.insert(t, topicOrders, "retried", 2)}
	parked := []uuid.UUID{e.insert(t, topicOrders, "parked", 0), e.insert(t, topicOrders, "parked", 1)}
	alone := e.insert(t, topicOrders, "alone", 0)
	good := e.insert(t, topicOrders, "good", 0)

	published, failed, err := r.RunOnce(e.ctx)
	require.NoError(t, err)
	require.Equal(t, 1, published, "the good key")
	require.Equal(t, 3, failed, "the 503, the 410 and the lone NotSent; not the rows held back")
	require.True(t, e.row(t, good).Published)

	// Behind the 503: pending, no attempt spent, due with it (an hour).
	head := e.row(t, retried[0])
	require.Equal(t, "pending", head.Status)
	require.Equal(t, 1, head.Attempts)
	for _, id := range retried[1:] {
		got := e.row(t, id)
		require.Equal(t, "pending", got.Status, "held back behind the 503")
		require.Zero(t, got.Attempts, "held back: no attempt spent")
		require.InDelta(t, head.DueIn.Seconds(), got.DueIn.Seconds(), 1, "due with the message it waits behind")
		require.Contains(t, got.LastError, "not sent")
	}
	// Behind the 410: the head is parked, the other due at once.
	require.Equal(t, "dead", e.row(t, parked[0]).Status)
	behind := e.row(t, parked[1])
	require.Equal(t, "pending", behind.Status, "not parked with the 410")
	require.Zero(t, behind.Attempts)
	require.LessOrEqual(t, behind.DueIn, time.Duration(0), "due at once")
	// NotSent with nothing failed before it: an attempt spent.
	lone := e.row(t, alone)
	require.Equal(t, "pending", lone.Status)
	require.Equal(t, 1, lone.Attempts, "a NotSent with no failure of its key counts as an attempt")
	require.Contains(t, lone.LastError, "no failed message of its key")

	// The next cycle sends the one behind the 410; the others wait.
	w.mu.Lock()
	w.verdict = func(kafka.Message) error { return nil }
	w.mu.Unlock()
	published, _, err = r.RunOnce(e.ctx)
	require.NoError(t, err)
	require.Equal(t, 1, published, "only the message behind the parked one was due")
	require.True(t, e.row(t, parked[1]).Published)
	for _, id := range retried {
		require.False(t, e.row(t, id).Published, "not due before the hour")
	}
}
