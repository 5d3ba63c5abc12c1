package relay_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/relay"
)

// hookWriter passes writes on to another Writer, after calling before with
// the write's number (1 for the first) and its messages. before may block,
// and it may fail messages: the entries of the kafka.WriteErrors it returns
// that are not nil are not passed on and are reported as failed.
type hookWriter struct {
	inner  relay.Writer
	before func(ctx context.Context, call int, msgs []kafka.Message) kafka.WriteErrors

	mu     sync.Mutex
	calls  int
	writes [][]kafka.Message // every write, failed messages included
	at     []time.Time       // when each write started
}

func (w *hookWriter) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	w.mu.Lock()
	w.calls++
	call := w.calls
	w.writes = append(w.writes, msgs)
	w.at = append(w.at, time.Now())
	w.mu.Unlock()
	var fail kafka.WriteErrors
	if w.before != nil {
		fail = w.before(ctx, call, msgs)
	}
	var pass []kafka.Message
	for i, m := range msgs {
		if fail == nil || fail[i] == nil {
			pass = append(pass, m)
		}
	}
	if len(pass) > 0 {
		if err := w.inner.WriteMessages(ctx, pass...); err != nil {
			return err
		}
	}
	if fail != nil && slicesAny(fail) {
		return fail
	}
	return nil
}

func (w *hookWriter) Close() error { return nil }

func (w *hookWriter) log() ([][]kafka.Message, []time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([][]kafka.Message(nil), w.writes...), append([]time.Time(nil), w.at...)
}

func slicesAny(errs kafka.WriteErrors) bool {
	for _, e := range errs {
		if e != nil {
			return true
		}
	}
	return false
}

// claimCounter counts the relay's claims that found rows, and closes
// reached once n of them have returned.
type claimCounter struct {
	mu      sync.Mutex
	n       int
	want    int
	reached chan struct{}
}

func countClaims(r *relay.Relay, want int) *claimCounter {
	c := &claimCounter{want: want, reached: make(chan struct{})}
	relay.SetAfterClaim(r, func(rows int) {
		if rows == 0 {
			return
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		c.n++
		if c.n == c.want {
			close(c.reached)
		}
	})
	return c
}

// wait reports whether the wanted number of claims returned within d.
func (c *claimCounter) wait(d time.Duration) bool {
	select {
	case <-c.reached:
		return true
	case <-time.After(d):
		return false
	}
}

// seqsOf returns the seq of each message whose key is key.
func seqsOf(t *testing.T, msgs []kafka.Message, key string) []int {
	t.Helper()
	var out []int
	for _, m := range msgs {
		if string(m.Key) == key {
			out = append(out, seqOf(t, m))
		}
	}
	return out
}

// TestRunningRelayClaimsTheNextBatchDuringTheWrite blocks the first write
// until a second claim has returned: a running relay claims batch N+1 while
// batch N is written. Everything is published once, and in order per key.
func TestRunningRelayClaimsTheNextBatchDuringTheWrite(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const batch, n = 10, 35
	overlapped := make(chan bool, 1)
	var claims *claimCounter
	w := &hookWriter{inner: e.writer(t), before: func(_ context.Context, call int, _ []kafka.Message) kafka.WriteErrors {
		if call == 1 {
			overlapped <- claims.wait(10 * time.Second)
		}
		return nil
	}}
	r := e.relay(t, w, relay.Config{BatchSize: batch})
	claims = countClaims(r, 2)
	for i := range n {
		e.insert(t, topicOrders, fmt.Sprintf("k%d", i%4), i)
	}
	require.NoError(t, r.Start(e.ctx))
	require.True(t, <-overlapped, "the second claim returned while the first write was blocked")
	waitFor(t, 15*time.Second, "every row published", func() bool { return e.count(t, store.OutboxPublished) == n })

	writes, _ := w.log()
	require.GreaterOrEqual(t, len(writes), 4, "batches of %d", batch)
	msgs := e.read(t, topicOrders)
	got := copies(t, msgs)
	require.Len(t, got, n)
	for id, c := range got {
		require.Equal(t, 1, c, "copies of %s", id)
	}
	for k := range 4 {
		seqs := seqsOf(t, msgs, fmt.Sprintf("k%d", k))
		require.IsIncreasing(t, seqs, "key k%d", k)
	}
}

// TestHeldBackBehindAFailedMessageOfItsKey fails the message of key K in
// the first batch while the second batch, claimed during that write, holds
// a later message of K: that message must not be written until the first
// one's failure is recorded, and it is held back untouched (no attempt
// spent, not marked). Without the guard the second write carries it, while
// the first batch's marks are still on their way.
func TestHeldBackBehindAFailedMessageOfItsKey(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const batch, n = 10, 25
	const key = "K"
	var claims *claimCounter
	var (
		ids        []uuid.UUID
		k1, k2     uuid.UUID // K's first message (batch 1) and second (batch 2)
		mu         sync.Mutex
		overlapped bool
		k2Seen     []int // K#1's attempts, each time K#2 is written (-1: not read)
	)
	w := &hookWriter{inner: e.writer(t)}
	w.before = func(ctx context.Context, call int, msgs []kafka.Message) kafka.WriteErrors {
		fail := make(kafka.WriteErrors, len(msgs))
		for i, m := range msgs {
			id, _ := header(m, store.HeaderMessageID)
			switch {
			case call == 1 && id == k1.String():
				ok := claims.wait(10 * time.Second)
				mu.Lock()
				overlapped = ok
				mu.Unlock()
				fail[i] = errors.New("injected: the broker refused this one")
			case id == k2.String():
				attempts := -1
				_ = e.pool.QueryRow(ctx, `SELECT attempts FROM `+pgx.Identifier{e.schema}.Sanitize()+
					`.outbox WHERE id = $1`, k1).Scan(&attempts)
				mu.Lock()
				k2Seen = append(k2Seen, attempts)
				mu.Unlock()
			}
		}
		return fail
	}
	r := e.relay(t, w, relay.Config{BatchSize: batch, PollInterval: 50 * time.Millisecond,
		Backoff: func(int) time.Duration { return 100 * time.Millisecond }})
	claims = countClaims(r, 2)
	for i := range n {
		k := fmt.Sprintf("k%d", i%3)
		if i == 4 || i == 13 {
			k = key // K#1 in the first batch of 10, K#2 in the second
		}
		id := e.insert(t, topicOrders, k, i)
		ids = append(ids, id)
		switch i {
		case 4:
			k1 = id
		case 13:
			k2 = id
		}
	}
	require.NoError(t, r.Start(e.ctx))
	waitFor(t, 15*time.Second, "every row published", func() bool { return e.count(t, store.OutboxPublished) == n })
	require.NoError(t, r.Stop(e.ctx))

	mu.Lock()
	defer mu.Unlock()
	require.True(t, overlapped, "batch 2 was claimed while batch 1 was written")
	writes, _ := w.log()
	require.GreaterOrEqual(t, len(writes), 3)
	for _, m := range writes[1] {
		id, _ := header(m, store.HeaderMessageID)
		require.NotEqual(t, k2.String(), id, "K#2 was written right after K#1 failed, in the batch claimed during that write")
	}
	require.Len(t, k2Seen, 1, "K#2 written once")
	require.Equal(t, 1, k2Seen[0], "K#2 was written only after K#1's failure was recorded")

	// Nothing lost, nothing doubled; K#2 spent one attempt, the one that
	// published it, and K#1 two.
	got := copies(t, e.read(t, topicOrders))
	require.Len(t, got, n)
	for _, id := range ids {
		require.Equal(t, 1, got[id.String()], "copies of %s", id)
		require.Equal(t, store.OutboxPublished, e.row(t, id).Status)
	}
	require.Equal(t, 1, e.row(t, k2).Attempts, "holding K#2 back spent no attempt")
	require.Equal(t, 2, e.row(t, k1).Attempts)
	msgs := e.read(t, topicOrders)
	for k := range 3 {
		require.IsIncreasing(t, seqsOf(t, msgs, fmt.Sprintf("k%d", k)), "key k%d", k)
	}
}

// TestBatchAfterAnOutageIsNotWritten makes the first batch's write an
// outage while the second batch, claimed during it, waits: the second
// batch is released unwritten, and the relay writes nothing until its
// outage pause has passed.
func TestBatchAfterAnOutageIsNotWritten(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const batch, n = 10, 25
	const pause = 300 * time.Millisecond
	var claims *claimCounter
	overlapped := make(chan bool, 1)
	w := &hookWriter{inner: e.writer(t)}
	w.before = func(_ context.Context, call int, msgs []kafka.Message) kafka.WriteErrors {
		if call != 1 {
			return nil
		}
		overlapped <- claims.wait(10 * time.Second)
		fail := make(kafka.WriteErrors, len(msgs))
		for i := range fail {
			fail[i] = &relay.PublishError{Outage: true, Err: errors.New("injected: broker down")}
		}
		return fail
	}
	r := e.relay(t, w, relay.Config{BatchSize: batch, PollInterval: 50 * time.Millisecond,
		Backoff: func(int) time.Duration { return pause }})
	claims = countClaims(r, 2)
	var ids []uuid.UUID
	for i := range n {
		ids = append(ids, e.insert(t, topicOrders, fmt.Sprintf("k%d", i%3), i))
	}
	require.NoError(t, r.Start(e.ctx))
	require.True(t, <-overlapped, "batch 2 was claimed while batch 1 was written")
	waitFor(t, 15*time.Second, "every row published", func() bool { return e.count(t, store.OutboxPublished) == n })
	require.NoError(t, r.Stop(e.ctx))

	writes, at := w.log()
	require.GreaterOrEqual(t, len(writes), 2)
	require.GreaterOrEqual(t, at[1].Sub(at[0]), pause-50*time.Millisecond,
		"the batch claimed during the outage was written right after it")
	got := copies(t, e.read(t, topicOrders))
	require.Len(t, got, n)
	for _, id := range ids {
		require.Equal(t, 1, got[id.String()], "copies of %s", id)
		require.Equal(t, 1, e.row(t, id).Attempts, "an outage spends no attempt")
	}
}

// TestGracefulStopReleasesTheBatchClaimedBehindTheWrite stops the relay
// while its first write is blocked and the second batch is claimed: Stop
// lets the first batch be published and marked, and releases the second
// untouched.
func TestGracefulStopReleasesTheBatchClaimedBehindTheWrite(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const batch, n = 10, 25
	var claims *claimCounter
	inWrite := make(chan struct{})
	proceed := make(chan struct{})
	w := &hookWriter{inner: e.writer(t)}
	w.before = func(_ context.Context, call int, _ []kafka.Message) kafka.WriteErrors {
		if call == 1 {
			claims.wait(10 * time.Second)
			close(inWrite)
			<-proceed
		}
		return nil
	}
	r := e.relay(t, w, relay.Config{BatchSize: batch})
	claims = countClaims(r, 2)
	for i := range n {
		e.insert(t, topicOrders, fmt.Sprintf("k%d", i%3), i)
	}
	require.NoError(t, r.Start(e.ctx))
	<-inWrite
	stopped := make(chan error, 1)
	go func() { stopped <- r.Stop(e.ctx) }()
	// Stop waits for the write in flight.
	select {
	case err := <-stopped:
		t.Fatalf("Stop returned (%v) while a write was in flight", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(proceed)
	require.NoError(t, <-stopped)

	writes, _ := w.log()
	require.Len(t, writes, 1, "nothing written after the batch in flight")
	require.Equal(t, batch, e.count(t, store.OutboxPublished))
	require.Equal(t, n-batch, e.count(t, store.OutboxPending))
	var touched int
	require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT count(*) FROM `+pgx.Identifier{e.schema}.Sanitize()+`.outbox
		WHERE status = 'pending' AND (attempts > 0 OR last_error IS NOT NULL)`).Scan(&touched))
	require.Zero(t, touched, "the released batch's rows are untouched")
}

// TestStopAndCancelReleasesBothBatches cancels the relay while its first
// write hangs and the second batch is claimed: both batches roll back, and
// every row is pending, untouched and unlocked.
func TestStopAndCancelReleasesBothBatches(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const batch, n = 10, 25
	var claims *claimCounter
	inWrite := make(chan struct{})
	w := &hookWriter{inner: e.writer(t)}
	w.before = func(ctx context.Context, call int, _ []kafka.Message) kafka.WriteErrors {
		if call == 1 {
			claims.wait(10 * time.Second)
			close(inWrite)
			<-ctx.Done() // the broker hangs until the relay gives up
		}
		return nil
	}
	r := e.relay(t, w, relay.Config{BatchSize: batch})
	claims = countClaims(r, 2)
	for i := range n {
		e.insert(t, topicOrders, fmt.Sprintf("k%d", i%3), i)
	}
	require.NoError(t, r.Start(e.ctx))
	<-inWrite
	require.NoError(t, r.StopAndCancel(e.ctx))

	require.Equal(t, n, e.count(t, store.OutboxPending))
	tx, err := e.pool.Begin(e.ctx)
	require.NoError(t, err)
	defer func() { require.NoError(t, tx.Rollback(e.ctx)) }()
	ms, err := e.st.ClaimRelayBatch(e.ctx, tx, n)
	require.NoError(t, err)
	require.Len(t, ms, n, "no row is still locked")
	for _, m := range ms {
		require.Zero(t, m.Attempts, "row %s was touched", m.ID)
	}
}

// TestDrainComesBackForARowItSkipped: while a relay drains a backlog, its
// claims start after the last row it claimed (so that they do not walk the
// index entries of the rows it published); a row before that point, which
// another transaction held locked when its turn came, is still published
// during the drain, by the claim from the start that the relay makes every
// few batches, not only once the whole backlog is out.
func TestDrainComesBackForARowItSkipped(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const batch, n = 10, 400
	locked := e.insert(t, topicOrders, "late", -1)
	for i := range n {
		e.insert(t, topicOrders, fmt.Sprintf("k%d", i%8), i)
	}
	// Another transaction holds the oldest row when the drain starts.
	holder, err := e.pool.Begin(e.ctx)
	require.NoError(t, err)
	_, err = holder.Exec(e.ctx, "SELECT 1 FROM "+pgx.Identifier{e.schema}.Sanitize()+".outbox WHERE id = $1 FOR UPDATE", locked)
	require.NoError(t, err)
	released := make(chan struct{})
	w := &hookWriter{inner: e.writer(t), before: func(_ context.Context, call int, _ []kafka.Message) kafka.WriteErrors {
		if call == 3 {
			require.NoError(t, holder.Commit(context.Background()))
			close(released)
		}
		time.Sleep(2 * time.Millisecond) // a drain of some length
		return nil
	}}
	r := e.relay(t, w, relay.Config{BatchSize: batch})
	require.NoError(t, r.Start(e.ctx))
	<-released
	waitFor(t, 30*time.Second, "every row published", func() bool { return e.count(t, store.OutboxPublished) == n+1 })

	writes, _ := w.log()
	at := -1
	for i, ms := range writes {
		for _, m := range ms {
			if id, _ := header(m, store.HeaderMessageID); id == locked.String() {
				at = i
			}
		}
	}
	require.GreaterOrEqual(t, at, 3, "the locked row was not written before its lock was released")
	require.Less(t, at, 3+20, "the locked row was written within a few batches of its release (of %d writes), not after the backlog", len(writes))
	require.Greater(t, len(writes), 3+25, "the backlog outlasted that")
	got := copies(t, e.read(t, topicOrders))
	require.Len(t, got, n+1)
	for id, c := range got {
		require.Equal(t, 1, c, "copies of %s", id)
	}
}
