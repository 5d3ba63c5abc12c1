package review30_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/inbox"
)

// reader is an inbox.Reader fed by a channel; it records commits.
type reader struct {
	ch      chan kafka.Message
	mu      sync.Mutex
	commits []kafka.Message
}

func newReader(msgs ...kafka.Message) *reader {
	r := &reader{ch: make(chan kafka.Message, len(msgs)+16)}
	for _, m := range msgs {
		r.ch <- m
	}
	return r
}

func (r *reader) FetchMessage(ctx context.Context) (kafka.Message, error) {
	select {
	case m := <-r.ch:
		return m, nil
	case <-ctx.Done():
		return kafka.Message{}, ctx.Err()
	}
}

func (r *reader) CommitMessages(_ context.Context, msgs ...kafka.Message) error {
	r.mu.Lock()
	r.commits = append(r.commits, msgs...)
	r.mu.Unlock()
	return nil
}

func (r *reader) committed() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.commits)
}

// kmsg is a Kafka message with a sagaflow message id and type.
func kmsg(topic string, offset int64, id, typ string) kafka.Message {
	return kafka.Message{Topic: topic, Partition: 0, Offset: offset, Key: []byte("k"), Value: []byte(`{"v":1}`),
		Headers: []kafka.Header{{Key: "sagaflow-message-id", Value: []byte(id)}, {Key: "sagaflow-type", Value: []byte(typ)}}}
}

// runConsumer starts c and stops it when the test ends.
func runConsumer(t *testing.T, c *inbox.Consumer) {
	t.Helper()
	if err := c.Start(context.Background()); err != nil {
		t.Fatalf("start consumer: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := c.Stop(ctx); err != nil {
			t.Errorf("stop consumer: %v", err)
		}
	})
}

func deadLetters(t testing.TB, pool *pgxpool.Pool, schema string) int64 {
	return count(t, pool, `SELECT count(*) FROM `+table(schema, "dead_letters"))
}

// TestConsumerRetryOfTheLongestDurationWaits: "RetryInitial and RetryMax
// space the retries of a handler that failed with an error that is not
// permanent" and a failing message "holds its partition, so order is kept,
// until MaxAttempts". With both at time.Duration's longest, a failing
// handler must not be tried again within seconds (and so not be
// dead-lettered after MaxAttempts quick tries).
func TestConsumerRetryOfTheLongestDurationWaits(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	in, err := inbox.New(pool, &inbox.Config{Consumer: "r30-retry", Schema: schema, Logger: discard})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	r := newReader(kmsg("r30.retry", 1, "m-1", "T"))
	c, err := in.NewConsumer(r, &inbox.ConsumerConfig{
		Handlers: map[string]inbox.HandlerFunc{"T": func(context.Context, pgx.Tx, inbox.Message) error {
			runs.Add(1)
			return errors.New("not yet")
		}},
		RetryInitial: math.MaxInt64, RetryMax: math.MaxInt64, MaxAttempts: 20,
	})
	if err != nil {
		t.Logf("NewConsumer refused the config (fine): %v", err)
		return
	}
	runConsumer(t, c)
	waitFor(t, 10*time.Second, "the first run", func() bool { return runs.Load() >= 1 })
	time.Sleep(1500 * time.Millisecond)
	if n, dl := runs.Load(), deadLetters(t, pool, schema); n != 1 || dl != 0 {
		t.Fatalf("with retries spaced by time.Duration's longest, the handler ran %d times within 1.5 s and %d dead letters were written, want 1 run and none", n, dl)
	}
}

// TestConsumerRetryOfDaysWaits: the same with a spacing of 25 and 30 days
// (past 2^31 ms), which must simply wait.
func TestConsumerRetryOfDaysWaits(t *testing.T) {
	t.Parallel()
	for _, d := range []time.Duration{37 * time.Minute, 25 * 24 * time.Hour, 30 * 24 * time.Hour, 10 * 365 * 24 * time.Hour, 250 * 365 * 24 * time.Hour} {
		t.Run(d.String(), func(t *testing.T) {
			t.Parallel()
			pool, schema := db(t)
			in, err := inbox.New(pool, &inbox.Config{Consumer: "r30-days", Schema: schema, Logger: discard})
			if err != nil {
				t.Fatal(err)
			}
			var runs atomic.Int64
			r := newReader(kmsg("r30.days", 1, "m-1", "T"))
			c, err := in.NewConsumer(r, &inbox.ConsumerConfig{
				Handlers: map[string]inbox.HandlerFunc{"T": func(context.Context, pgx.Tx, inbox.Message) error {
					runs.Add(1)
					return errors.New("not yet")
				}},
				RetryInitial: d, RetryMax: d, MaxAttempts: 20,
			})
			if err != nil {
				t.Fatalf("NewConsumer: %v", err)
			}
			runConsumer(t, c)
			waitFor(t, 10*time.Second, "the first run", func() bool { return runs.Load() >= 1 })
			time.Sleep(500 * time.Millisecond)
			if n := runs.Load(); n != 1 {
				t.Fatalf("retries spaced %v: the handler ran %d times within 0.5 s, want 1", d, n)
			}
		})
	}
}

// TestConsumerRetentionExtremes: a running consumer "deletes older ones
// every RetentionInterval"; keys younger than Retention stay. With a
// Retention of years or time.Duration's longest, and a short interval, the
// consumer keeps every key and logs no error; with a negative one it keeps
// them too ("negative keeps them").
func TestConsumerRetentionExtremes(t *testing.T) {
	t.Parallel()
	for _, ret := range []time.Duration{37 * time.Minute, 25 * 24 * time.Hour, 10 * 365 * 24 * time.Hour, math.MaxInt64, -1, math.MinInt64} {
		t.Run(fmt.Sprint(ret), func(t *testing.T) {
			t.Parallel()
			pool, schema := db(t)
			lg := &logs{}
			in, err := inbox.New(pool, &inbox.Config{Consumer: "r30-ret", Schema: schema, Logger: lg.logger()})
			if err != nil {
				t.Fatal(err)
			}
			var runs atomic.Int64
			r := newReader(kmsg("r30.ret", 1, "m-1", "T"), kmsg("r30.ret", 2, "m-2", "T"))
			c, err := in.NewConsumer(r, &inbox.ConsumerConfig{
				Handlers: map[string]inbox.HandlerFunc{"T": func(context.Context, pgx.Tx, inbox.Message) error {
					runs.Add(1)
					return nil
				}},
				Retention: ret, RetentionInterval: 10 * time.Millisecond,
			})
			if err != nil {
				t.Fatalf("NewConsumer: %v", err)
			}
			runConsumer(t, c)
			waitFor(t, 10*time.Second, "both messages committed", func() bool { return r.committed() == 2 })
			time.Sleep(300 * time.Millisecond) // ~30 retention passes
			if n := count(t, pool, `SELECT count(*) FROM `+table(schema, "inbox")); n != 2 {
				t.Errorf("Retention %v: %d inbox keys left, want 2", ret, n)
			}
			if e := lg.errors(); len(e) > 0 {
				t.Errorf("Retention %v: the consumer logged errors: %q", ret, e)
			}
			// A redelivery is still a duplicate.
			r.ch <- kmsg("r30.ret", 1, "m-1", "T")
			waitFor(t, 10*time.Second, "the redelivery committed", func() bool { return r.committed() == 3 })
			if n := runs.Load(); n != 2 {
				t.Errorf("Retention %v: handler ran %d times for 2 messages and a redelivery, want 2", ret, n)
			}
		})
	}
}

// TestDeleteProcessedExtremes: DeleteProcessed "deletes this consumer's
// inbox keys processed longer than olderThan ago, at most batch rows per
// statement, and returns how many it deleted". Ages of years and
// time.Duration's longest delete nothing; batch sizes of 1, 2^31 and int's
// largest delete everything that is old enough.
func TestDeleteProcessedExtremes(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	ctx := context.Background()
	in, err := inbox.New(pool, &inbox.Config{Consumer: "r30-del", Schema: schema, Logger: discard})
	if err != nil {
		t.Fatal(err)
	}
	process := func(n int, prefix string) {
		for i := range n {
			_, err := in.Process(ctx, inbox.Message{ID: fmt.Sprintf("%s-%d", prefix, i)}, func(context.Context, pgx.Tx, inbox.Message) error { return nil })
			if err != nil {
				t.Fatalf("process: %v", err)
			}
		}
	}
	keys := func() int64 { return count(t, pool, `SELECT count(*) FROM `+table(schema, "inbox")) }
	process(5, "a")
	for _, old := range []time.Duration{37 * time.Minute, 25 * 24 * time.Hour, 30 * 24 * time.Hour, 100 * 365 * 24 * time.Hour, math.MaxInt64} {
		for _, batch := range []int{1, 1000, 1 << 31, math.MaxInt32, math.MaxInt} {
			n, err := in.DeleteProcessed(ctx, old, batch)
			if err != nil || n != 0 {
				t.Errorf("DeleteProcessed(%v, %d) = %d, %v; want 0 deleted, no error", old, batch, n, err)
			}
		}
	}
	if k := keys(); k != 5 {
		t.Fatalf("%d keys left, want 5", k)
	}
	time.Sleep(5 * time.Millisecond)
	for i, batch := range []int{1 << 31, math.MaxInt, 1} {
		n, err := in.DeleteProcessed(ctx, time.Microsecond, batch)
		if err != nil || n != 5 {
			t.Errorf("DeleteProcessed(1µs, %d) = %d, %v; want 5 deleted", batch, n, err)
		}
		if i < 2 {
			process(5, fmt.Sprintf("b%d", i))
			time.Sleep(5 * time.Millisecond)
		}
	}
	if k := keys(); k != 0 {
		t.Fatalf("%d keys left, want 0", k)
	}
}

// TestConsumerConfigExtremes: negative intervals, attempts and sizes, and a
// BatchSize of int's largest, are refused by NewConsumer (ErrInvalidConfig)
// or work: the consumer must not panic, and must process a message once.
// Run in a child process.
func TestConsumerConfigExtremes(t *testing.T) {
	if !isChild(t) {
		t.Parallel()
		out, err := inChild(t, 60*time.Second)
		if err != nil || strings.Contains(out, "panic:") {
			t.Fatalf("the child failed (%v):\n%s", err, tail(out, 40))
		}
		return
	}
	pool, schema := db(t)
	cases := map[string]inbox.ConsumerConfig{
		"RetentionInterval": {RetentionInterval: -time.Second},
		"RetryInitial":      {RetryInitial: -time.Second},
		"RetryMax":          {RetryMax: -time.Second},
		"MaxAttempts":       {MaxAttempts: -1},
		"MaxMessageBytes":   {MaxMessageBytes: -1},
		"BatchSize":         {BatchSize: -1},
		"BatchSizeHuge":     {BatchSize: math.MaxInt},
		"RetentionInt1ns":   {RetentionInterval: time.Nanosecond},
	}
	for name, cfg := range cases {
		in, err := inbox.New(pool, &inbox.Config{Consumer: "r30-cfg-" + name, Schema: schema, Logger: discard})
		if err != nil {
			t.Fatal(err)
		}
		var runs atomic.Int64
		cfg.Handlers = map[string]inbox.HandlerFunc{"T": func(context.Context, pgx.Tx, inbox.Message) error { runs.Add(1); return nil }}
		r := newReader(kmsg("r30.cfg", 1, "m-"+name, "T"))
		c, err := in.NewConsumer(r, &cfg)
		if err != nil {
			t.Logf("%s: refused: %v", name, err)
			if !errors.Is(err, inbox.ErrInvalidConfig) {
				t.Errorf("%s: refused without ErrInvalidConfig: %v", name, err)
			}
			continue
		}
		if err := c.Start(context.Background()); err != nil {
			t.Fatalf("%s: start: %v", name, err)
		}
		deadline := time.Now().Add(5 * time.Second)
		for r.committed() < 1 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(50 * time.Millisecond)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := c.Stop(ctx); err != nil {
			t.Errorf("%s: stop: %v", name, err)
		}
		cancel()
		if runs.Load() != 1 || r.committed() != 1 {
			t.Errorf("%s: accepted; handler ran %d times, %d commits; want 1 and 1", name, runs.Load(), r.committed())
		}
		t.Logf("%s: accepted; processed once", name)
	}
}
