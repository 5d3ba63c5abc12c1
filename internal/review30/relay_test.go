package review30_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
)

// TestRelayBatchSizeBounds: BatchSize "Defaults to BatchSizeDefault; at
// most BatchSizeMax", and New returns ErrInvalidConfig, naming the field,
// for a configuration it refuses. 1 and BatchSizeMax work.
func TestRelayBatchSizeBounds(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	for _, n := range []int{relay.BatchSizeMax + 1, 1 << 31, math.MaxInt} {
		_, err := relay.New(pool, &writer{}, &relay.Config{Schema: schema, BatchSize: n})
		if !errors.Is(err, relay.ErrInvalidConfig) || !strings.Contains(err.Error(), "BatchSize") {
			t.Errorf("relay.New with BatchSize %d: %v, want ErrInvalidConfig naming BatchSize", n, err)
		}
	}
	insert(t, pool, schema, 5, outbox.Message{})
	for _, n := range []int{1, relay.BatchSizeMax} {
		w := &writer{}
		r, err := relay.New(pool, w, &relay.Config{Schema: schema, BatchSize: n, Logger: discard})
		if err != nil {
			t.Fatalf("relay.New with BatchSize %d: %v", n, err)
		}
		total := 0
		for {
			p, _, err := r.RunOnce(context.Background())
			if err != nil {
				t.Fatalf("RunOnce with BatchSize %d: %v", n, err)
			}
			if p > n {
				t.Fatalf("BatchSize %d: one cycle published %d", n, p)
			}
			if p == 0 {
				break
			}
			total += p
		}
		if total != 5 {
			t.Fatalf("BatchSize %d: published %d, want 5", n, total)
		}
		// Make them pending again for the next size.
		if _, err := pool.Exec(context.Background(), `UPDATE `+table(schema, "outbox")+` SET status = 'pending', published_at = NULL`); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRelayNegativeCountsAreRefusedOrDefault: a negative BatchSize,
// MaxAttempts or MaxMessageBytes is refused by New (naming the field) or
// works as something sensible: it must not make every cycle fail.
func TestRelayNegativeCountsAreRefusedOrDefault(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	insert(t, pool, schema, 3, outbox.Message{})
	for _, cfg := range []relay.Config{{BatchSize: -1}, {BatchSize: math.MinInt}, {MaxAttempts: -1}, {MaxAttempts: math.MinInt}, {MaxMessageBytes: -1}, {MaxMessageBytes: math.MinInt}} {
		cfg.Schema, cfg.Logger = schema, discard
		name := fmt.Sprintf("%+v", relay.Config{BatchSize: cfg.BatchSize, MaxAttempts: cfg.MaxAttempts, MaxMessageBytes: cfg.MaxMessageBytes})
		w := &writer{}
		r, err := relay.New(pool, w, &cfg)
		if err != nil {
			if !errors.Is(err, relay.ErrInvalidConfig) {
				t.Errorf("%s: New: %v, want ErrInvalidConfig", name, err)
			}
			continue
		}
		if _, _, err := r.RunOnce(context.Background()); err != nil {
			t.Errorf("%s: accepted by New, then RunOnce failed: %v", name, err)
		}
	}
}

// TestRelayRetriesWithExtremeBackoffs: Backoff "is how long a row that
// failed waits before its next attempt". A Backoff of 37 minutes, 25 or 30
// days, or time.Duration's longest holds the row (pending, no error, not
// published by the next cycle); a Backoff of 0 or a negative one makes it
// due at once. MaxAttempts of int's largest is no limit.
func TestRelayRetriesWithExtremeBackoffs(t *testing.T) {
	t.Parallel()
	for _, b := range []time.Duration{37 * time.Minute, 25 * 24 * time.Hour, 30 * 24 * time.Hour, math.MaxInt64, 0, -1, math.MinInt64} {
		t.Run(fmt.Sprint(b), func(t *testing.T) {
			t.Parallel()
			pool, schema := db(t)
			insert(t, pool, schema, 1, outbox.Message{Topic: "r30.backoff"})
			fail := true
			w := &writer{fail: func([]kafka.Message) error {
				if fail {
					return errors.New("r30: refused this once")
				}
				return nil
			}}
			r, err := relay.New(pool, w, &relay.Config{Schema: schema, Logger: discard, MaxAttempts: math.MaxInt,
				Backoff: func(int) time.Duration { return b }})
			if err != nil {
				t.Fatalf("relay.New: %v", err)
			}
			ctx := context.Background()
			p, f, err := r.RunOnce(ctx)
			if err != nil || p != 0 || f != 1 {
				t.Fatalf("first cycle: published %d, failed %d, err %v; want 0, 1, nil", p, f, err)
			}
			st := count(t, pool, `SELECT count(*) FROM `+table(schema, "outbox")+` WHERE status = 'pending'`)
			if st != 1 {
				t.Fatalf("after a failure with Backoff %v the row is not pending", b)
			}
			fail = false
			p, _, err = r.RunOnce(ctx)
			if err != nil {
				t.Fatalf("second cycle: %v", err)
			}
			wantP := 0
			if b <= 0 {
				wantP = 1
			}
			if p != wantP {
				t.Fatalf("Backoff %v: the second cycle published %d, want %d", b, p, wantP)
			}
		})
	}
}

// TestRelayRetentionExtremes: a running relay "deletes older ones every
// RetentionInterval"; published rows younger than Retention stay;
// "negative keeps them". With years, time.Duration's longest or a negative
// retention and an interval of a few milliseconds, published rows stay and
// nothing is logged as an error.
func TestRelayRetentionExtremes(t *testing.T) {
	t.Parallel()
	for _, ret := range []time.Duration{37 * time.Minute, 25 * 24 * time.Hour, 10 * 365 * 24 * time.Hour, math.MaxInt64, -1, math.MinInt64} {
		t.Run(fmt.Sprint(ret), func(t *testing.T) {
			t.Parallel()
			pool, schema := db(t)
			lg := &logs{}
			w := &writer{}
			r, err := relay.New(pool, w, &relay.Config{Schema: schema, Logger: lg.logger(), PollInterval: 10 * time.Millisecond,
				Retention: ret, RetentionInterval: 5 * time.Millisecond})
			if err != nil {
				t.Fatalf("relay.New: %v", err)
			}
			if err := r.Start(context.Background()); err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := r.Stop(context.Background()); err != nil {
					t.Errorf("stop: %v", err)
				}
			}()
			insert(t, pool, schema, 3, outbox.Message{})
			waitFor(t, 10*time.Second, "3 published", func() bool { return w.written() == 3 })
			time.Sleep(200 * time.Millisecond)
			if n := count(t, pool, `SELECT count(*) FROM `+table(schema, "outbox")+` WHERE status = 'published'`); n != 3 {
				t.Errorf("Retention %v: %d published rows kept, want 3", ret, n)
			}
			if e := lg.errors(); len(e) > 0 {
				t.Errorf("Retention %v: the relay logged errors: %q", ret, e[:min(len(e), 3)])
			}
		})
	}
}

// TestRelayNegativeIntervals: PollInterval, RetentionInterval,
// GaugeInterval, OutageBackoffMax, SweepAfter and PublishTimeout below zero
// are refused by New or work: a running relay must not panic (a panic in
// its goroutine would end the service) and must still publish. Run in a
// child process.
func TestRelayNegativeIntervals(t *testing.T) {
	if !isChild(t) {
		t.Parallel()
		out, err := inChild(t, 60*time.Second)
		if err != nil || strings.Contains(out, "panic:") {
			t.Fatalf("the child failed (%v):\n%s", err, tail(out, 40))
		}
		return
	}
	pool, schema := db(t)
	cases := map[string]relay.Config{
		"PollInterval":      {PollInterval: -time.Second},
		"RetentionInterval": {RetentionInterval: -time.Second},
		"GaugeInterval":     {GaugeInterval: -time.Second},
		"OutageBackoffMax":  {OutageBackoffMax: -time.Second},
		"PublishTimeout":    {PublishTimeout: -time.Second},
		"Sweeper":           {Sweeper: true, SweepAfter: -time.Second},
	}
	for name, cfg := range cases {
		if _, err := pool.Exec(context.Background(), `DELETE FROM `+table(schema, "outbox")); err != nil {
			t.Fatal(err)
		}
		cfg.Schema, cfg.Logger = schema, discard
		w := &writer{}
		r, err := relay.New(pool, w, &cfg)
		if err != nil {
			t.Logf("%s: refused by New: %v", name, err)
			if !errors.Is(err, relay.ErrInvalidConfig) || !strings.Contains(err.Error(), name) && name != "Sweeper" {
				t.Errorf("%s: refused without ErrInvalidConfig naming the field: %v", name, err)
			}
			continue
		}
		if err := r.Start(context.Background()); err != nil {
			t.Fatalf("%s: start: %v", name, err)
		}
		insert(t, pool, schema, 2, outbox.Message{Delay: 0})
		r.Wake()
		deadline := time.Now().Add(5 * time.Second)
		for w.written() < 2 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
			r.Wake()
		}
		if err := r.Stop(context.Background()); err != nil {
			t.Errorf("%s: stop: %v", name, err)
		}
		if w.written() < 2 && name != "Sweeper" && name != "PublishTimeout" {
			t.Errorf("%s negative: accepted by New, but the relay published %d of 2 within 5 s", name, w.written())
		}
		t.Logf("%s negative: accepted; published %d", name, w.written())
	}
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
