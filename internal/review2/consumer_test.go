package review2_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/relay"
)

// consumerRig is one schema, one in-process cluster with topic "payments",
// a relay that feeds it from the outbox, and an inbox consumer "pay" in
// group "pay" whose handler writes the message id to a business table.
type consumerRig struct {
	t      *testing.T
	pool   *pgxpool.Pool
	schema string
	kc     *kafkatest.Cluster
	relay  *relay.Relay
	in     *inbox.Inbox
}

func newConsumerRig(t *testing.T) *consumerRig {
	pool, schema := migrated(t)
	exec(t, pool, schema, "CREATE TABLE %s.charges (id text)")
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "payments"), kafkatest.GroupMinSessionTimeout(time.Second))
	in, err := inbox.New(pool, &inbox.Config{Consumer: "pay", Schema: schema})
	require.NoError(t, err)
	return &consumerRig{t: t, pool: pool, schema: schema, kc: kc, relay: newRelay(t, pool, schema, kc, relay.Config{}), in: in}
}

// send publishes one message of type "Charge" and returns its id.
func (r *consumerRig) send() string {
	id := insert(r.t, r.pool, r.schema, msg("payments", "order-1", "Charge"))
	publishAll(r.t, r.relay, 1)
	return id.String()
}

// charge writes msg's id to the business table.
func (r *consumerRig) charge(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
	_, err := tx.Exec(ctx, "INSERT INTO "+migrations.QuoteSchema(r.schema)+".charges VALUES ($1)", m.ID)
	return err
}

func (r *consumerRig) charges(id string) int {
	return count(r.t, r.pool, r.schema, "SELECT count(*) FROM %s.charges WHERE id = $1", id)
}

func (r *consumerRig) consumer(h inbox.HandlerFunc) *inbox.Consumer {
	c, _ := r.consumerAndReader(h)
	return c
}

// consumerAndReader is consumer, also returning the Reader, for a test that
// closes it (a service that restarts).
func (r *consumerRig) consumerAndReader(h inbox.HandlerFunc) (*inbox.Consumer, *kafka.Reader) {
	reader := groupReader(r.t, r.kc, "pay", "payments")
	c, err := r.in.NewConsumer(reader, &inbox.ConsumerConfig{
		Handlers:          map[string]inbox.HandlerFunc{"Charge": h},
		RetryInitial:      10 * time.Millisecond,
		RetryMax:          50 * time.Millisecond,
		RetentionInterval: time.Hour,
	})
	require.NoError(r.t, err)
	r.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = c.Stop(ctx)
	})
	return c, reader
}

// Docs: "Stop on a consumer that is not running returns nil." Twice too.
func TestConsumerStopWithoutStart(t *testing.T) {
	t.Parallel()
	r := newConsumerRig(t)
	c := r.consumer(r.charge)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	require.NoError(t, c.Stop(ctx))
	require.NoError(t, c.Stop(ctx))
}

// Docs: "Calling it on a running consumer does nothing". Started twice, the
// consumer still runs one handler at a time and each message once; after Stop,
// Stop again returns nil, and Start runs it again.
func TestConsumerStartTwiceThenStopThenStartAgain(t *testing.T) {
	t.Parallel()
	r := newConsumerRig(t)
	ctx := context.Background()
	var running, maxRunning atomic.Int32
	c := r.consumer(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		n := running.Add(1)
		defer running.Add(-1)
		for {
			old := maxRunning.Load()
			if n <= old || maxRunning.CompareAndSwap(old, n) {
				break
			}
		}
		time.Sleep(20 * time.Millisecond)
		return r.charge(ctx, tx, m)
	})
	require.NoError(t, c.Start(ctx))
	require.NoError(t, c.Start(ctx))
	var ids []string
	for range 3 {
		ids = append(ids, r.send())
	}
	eventually(t, 20*time.Second, func() bool { return r.charges(ids[2]) == 1 }, "the third message was not processed")
	stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, c.Stop(stopCtx))
	require.NoError(t, c.Stop(stopCtx))
	for _, id := range ids {
		require.Equal(t, 1, r.charges(id), "message %s", id)
	}
	require.Equal(t, int32(1), maxRunning.Load(), "two handlers ran at once")
	require.Equal(t, int64(3), committedOffset(t, r.kc, "pay", "payments"))

	// Start after Stop.
	require.NoError(t, c.Start(ctx))
	id := r.send()
	eventually(t, 20*time.Second, func() bool { return r.charges(id) == 1 }, "a consumer started again after Stop processed nothing")
	require.NoError(t, c.Stop(stopCtx))
	require.Equal(t, int64(4), committedOffset(t, r.kc, "pay", "payments"))
}

// Docs: "Stop stops fetching, lets the message in flight finish (and its
// offset be committed), and returns once the consumer's goroutines have
// exited" and "calling it while Stop is in progress returns an error."
func TestConsumerStopLetsInFlightFinish(t *testing.T) {
	t.Parallel()
	r := newConsumerRig(t)
	ctx := context.Background()
	started, release := make(chan string, 4), make(chan struct{})
	c := r.consumer(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		if err := r.charge(ctx, tx, m); err != nil {
			return err
		}
		started <- m.ID
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	require.NoError(t, c.Start(ctx))
	id := r.send()
	second := r.send()
	select {
	case got := <-started:
		require.Equal(t, id, got)
	case <-time.After(20 * time.Second):
		t.Fatal("the handler never ran")
	}

	stopped := make(chan error, 1)
	go func() {
		stopCtx, cancel := context.WithTimeout(ctx, 15*time.Second)
		defer cancel()
		stopped <- c.Stop(stopCtx)
	}()
	select {
	case err := <-stopped:
		t.Fatalf("Stop returned (%v) while the handler was still running", err)
	case <-time.After(300 * time.Millisecond):
	}
	require.Error(t, c.Start(ctx), "Start while Stop is in progress")
	close(release)
	select {
	case err := <-stopped:
		require.NoError(t, err)
	case <-time.After(15 * time.Second):
		t.Fatal("Stop did not return after the handler finished")
	}
	require.Equal(t, 1, r.charges(id), "the message in flight did not commit")
	require.True(t, recorded(t, r.pool, r.schema, "pay", id), "its id is not in the inbox")
	require.Equal(t, int64(1), committedOffset(t, r.kc, "pay", "payments"), "its offset was not committed")
	require.Equal(t, 0, r.charges(second), "Stop did not stop fetching")
	select {
	case got := <-started:
		t.Fatalf("a handler ran after Stop: %s", got)
	default:
	}
}

// Docs: "if ctx ends first, the message in flight is abandoned (its
// transaction rolls back and it is redelivered) and Stop returns ctx.Err()."
func TestConsumerStopDeadlineAbandonsInFlight(t *testing.T) {
	t.Parallel()
	r := newConsumerRig(t)
	ctx := context.Background()
	started := make(chan string, 4)
	var block atomic.Bool
	block.Store(true)
	c, reader := r.consumerAndReader(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		if err := r.charge(ctx, tx, m); err != nil {
			return err
		}
		started <- m.ID
		if block.Load() {
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	})
	require.NoError(t, c.Start(ctx))
	id := r.send()
	select {
	case <-started:
	case <-time.After(20 * time.Second):
		t.Fatal("the handler never ran")
	}
	stopCtx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	err := c.Stop(stopCtx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Equal(t, 0, r.charges(id), "the abandoned message's transaction committed")
	require.Equal(t, int64(-1), committedOffset(t, r.kc, "pay", "payments"), "the abandoned message's offset was committed")

	// Redelivered: the service closes its reader, leaving the group, and a
	// new consumer in the group (the restarted service) gets the message.
	require.NoError(t, reader.Close())
	block.Store(false)
	c2 := r.consumer(r.charge)
	require.NoError(t, c2.Start(ctx))
	eventually(t, 30*time.Second, func() bool { return r.charges(id) == 1 }, "the abandoned message was never redelivered")
	stopCtx2, cancel2 := context.WithTimeout(ctx, 10*time.Second)
	defer cancel2()
	require.NoError(t, c2.Stop(stopCtx2))
}

// The same Consumer started again after a Stop that abandoned a message:
// "it is redelivered" must hold, or the next message's commit skips it.
func TestConsumerRestartAfterAbandonKeepsMessage(t *testing.T) {
	t.Parallel()
	r := newConsumerRig(t)
	ctx := context.Background()
	started := make(chan string, 8)
	var block atomic.Bool
	block.Store(true)
	c := r.consumer(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		if err := r.charge(ctx, tx, m); err != nil {
			return err
		}
		started <- m.ID
		if block.Load() {
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	})
	require.NoError(t, c.Start(ctx))
	first := r.send()
	select {
	case <-started:
	case <-time.After(20 * time.Second):
		t.Fatal("the handler never ran")
	}
	stopCtx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, c.Stop(stopCtx), context.DeadlineExceeded)

	block.Store(false)
	second := r.send()
	require.NoError(t, c.Start(ctx))
	eventually(t, 20*time.Second, func() bool { return r.charges(second) == 1 }, "the restarted consumer processed nothing")
	stopCtx2, cancel2 := context.WithTimeout(ctx, 10*time.Second)
	defer cancel2()
	require.NoError(t, c.Stop(stopCtx2))
	// Was a finding: the restarted consumer committed past the abandoned
	// message. It is taken up first now.
	require.Equal(t, 1, r.charges(first), "committed offset %d; message %s abandoned by Stop was never processed",
		committedOffset(t, r.kc, "pay", "payments"), first)
}

// Docs: "Cancelling ctx stops the consumer hard." Stop afterwards returns
// promptly, and the Consumer can be started again.
func TestConsumerStartCtxCancelled(t *testing.T) {
	t.Parallel()
	r := newConsumerRig(t)
	c := r.consumer(r.charge)
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, c.Start(ctx))
	id := r.send()
	eventually(t, 20*time.Second, func() bool { return r.charges(id) == 1 }, "not processed")
	cancel()
	stopCtx, cancelStop := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancelStop()
	err := c.Stop(stopCtx)
	require.True(t, err == nil || errors.Is(err, context.Canceled), "Stop after a hard stop: %v", err)
	require.NoError(t, c.Start(context.Background()))
	id2 := r.send()
	eventually(t, 20*time.Second, func() bool { return r.charges(id2) == 1 }, "not processed after restart")
	require.NoError(t, c.Stop(stopCtx))
}

// Run and Start on one Consumer at once: the docs say nothing; two loops on
// one Reader must at least not process a message twice.
func TestConsumerRunWhileStarted(t *testing.T) {
	t.Parallel()
	r := newConsumerRig(t)
	var mu sync.Mutex
	seen := map[string]int{}
	c := r.consumer(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		mu.Lock()
		seen[m.ID]++
		mu.Unlock()
		return r.charge(ctx, tx, m)
	})
	ctx := context.Background()
	require.NoError(t, c.Start(ctx))
	runCtx, cancelRun := context.WithCancel(ctx)
	runErr := make(chan error, 1)
	go func() { runErr <- c.Run(runCtx) }()
	var ids []string
	for range 3 {
		ids = append(ids, r.send())
	}
	eventually(t, 20*time.Second, func() bool { return r.charges(ids[2]) == 1 }, "not processed")
	cancelRun()
	select {
	case err := <-runErr:
		t.Logf("Run while started returned %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its ctx ended")
	}
	stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, c.Stop(stopCtx))
	for _, id := range ids {
		require.Equal(t, 1, r.charges(id))
	}
}

// A message whose handler keeps failing is retried with backoff and "holds
// its partition ... until MaxAttempts" (about an hour by default). Stop "lets
// the message in flight finish": the worst user reads that as waiting out
// the retries. Stop must not hang on a message that is only waiting for its
// next attempt; and its offset must stay uncommitted.
func TestConsumerStopDuringRetryBackoff(t *testing.T) {
	t.Parallel()
	r := newConsumerRig(t)
	ctx := context.Background()
	var attempts atomic.Int32
	reader := groupReader(t, r.kc, "pay", "payments")
	c, err := r.in.NewConsumer(reader, &inbox.ConsumerConfig{
		Handlers: map[string]inbox.HandlerFunc{"Charge": func(context.Context, pgx.Tx, inbox.Message) error {
			attempts.Add(1)
			return errors.New("payment provider unavailable")
		}},
		RetryInitial: 5 * time.Second,
		RetryMax:     5 * time.Second,
		MaxAttempts:  100,
	})
	require.NoError(t, err)
	require.NoError(t, c.Start(ctx))
	id := r.send()
	eventually(t, 20*time.Second, func() bool { return attempts.Load() >= 1 }, "the handler never ran")
	time.Sleep(100 * time.Millisecond) // now waiting for its second attempt
	stopCtx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	begin := time.Now()
	err = c.Stop(stopCtx)
	took := time.Since(begin)
	t.Logf("Stop during a retry wait: %v after %s, %d attempts", err, took, attempts.Load())
	require.Equal(t, int64(-1), committedOffset(t, r.kc, "pay", "payments"), "a message that never succeeded had its offset committed")
	require.False(t, recorded(t, r.pool, r.schema, "pay", id))
	// Was a finding: Stop slept through the retry backoff.
	require.NoError(t, err)
	require.Less(t, took, 2*time.Second)
}

// Two goroutines stop one consumer while its handler runs (a signal handler
// and a deferred Stop): the relay promises this is safe; the consumer's docs
// do not say. Both must return once the message committed.
func TestConsumerConcurrentStops(t *testing.T) {
	t.Parallel()
	r := newConsumerRig(t)
	ctx := context.Background()
	started, release := make(chan struct{}, 1), make(chan struct{})
	c := r.consumer(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		started <- struct{}{}
		<-release
		return r.charge(ctx, tx, m)
	})
	require.NoError(t, c.Start(ctx))
	id := r.send()
	select {
	case <-started:
	case <-time.After(20 * time.Second):
		t.Fatal("the handler never ran")
	}
	errs := make(chan error, 2)
	for range 2 {
		go func() {
			stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			errs <- c.Stop(stopCtx)
		}()
	}
	time.Sleep(100 * time.Millisecond)
	close(release)
	for range 2 {
		select {
		case err := <-errs:
			require.NoError(t, err)
		case <-time.After(15 * time.Second):
			t.Fatal("a concurrent Stop did not return")
		}
	}
	require.Equal(t, 1, r.charges(id))
	require.Equal(t, int64(1), committedOffset(t, r.kc, "pay", "payments"))
}

// A handler that ignores its ctx (a blocking call without a deadline): Stop
// with a deadline must still return ctx.Err() at the deadline, and when the
// handler finally returns nil, its transaction must not commit: "the message
// in flight is abandoned (its transaction rolls back and it is redelivered)".
func TestConsumerStopDeadlineHandlerIgnoresCtx(t *testing.T) {
	t.Parallel()
	r := newConsumerRig(t)
	ctx := context.Background()
	started, release, returned := make(chan struct{}, 1), make(chan struct{}), make(chan struct{})
	c := r.consumer(func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		defer close(returned)
		// The write happens before the stall, on a live ctx.
		if err := r.charge(ctx, tx, m); err != nil {
			return err
		}
		started <- struct{}{}
		<-release
		return nil
	})
	require.NoError(t, c.Start(ctx))
	id := r.send()
	select {
	case <-started:
	case <-time.After(20 * time.Second):
		t.Fatal("the handler never ran")
	}
	stopCtx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	stopped := make(chan error, 1)
	go func() { stopped <- c.Stop(stopCtx) }()
	var stopErr error
	hung := false
	select {
	case stopErr = <-stopped:
		close(release)
	case <-time.After(2 * time.Second):
		hung = true
		close(release)
		select {
		case stopErr = <-stopped:
		case <-time.After(10 * time.Second):
			t.Fatal("Stop did not return even after the handler did")
		}
	}
	require.ErrorIs(t, stopErr, context.DeadlineExceeded)
	<-returned
	time.Sleep(300 * time.Millisecond) // whatever the consumer does after the handler returns
	require.Equal(t, 0, r.charges(id), "the abandoned message's transaction committed after its ctx ended")
	require.Equal(t, int64(-1), committedOffset(t, r.kc, "pay", "payments"), "the abandoned message's offset was committed")
	// Was a finding against the docs; the docs now say it: "a handler that
	// ignores its context holds Stop up".
	require.True(t, hung, "Stop returned before a handler that ignores its ctx")
}
