package review30_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
)

// publishAll publishes every due row of schema through a recording writer.
func publishAll(t testing.TB, pool *pgxpool.Pool, schema string) *writer {
	t.Helper()
	w := &writer{}
	r, err := relay.New(pool, w, &relay.Config{Schema: schema, Logger: discard})
	if err != nil {
		t.Fatal(err)
	}
	for {
		n, _, err := r.RunOnce(context.Background())
		if err != nil {
			t.Fatalf("RunOnce: %v", err)
		}
		if n == 0 {
			return w
		}
	}
}

// TestOutboxDelayExtremes: Delay "holds the message back this long after
// the database's now()". Delays of 37 minutes, 25 and 30 days, years and
// time.Duration's longest are written and held (the relay publishes none of
// them now); a delay of a nanosecond or a microsecond is due at once.
func TestOutboxDelayExtremes(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	ctx := context.Background()
	ob, err := outbox.New(pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []time.Duration{37 * time.Minute, 25 * 24 * time.Hour, 30 * 24 * time.Hour, 100 * 365 * 24 * time.Hour, math.MaxInt64} {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return ob.InsertTx(ctx, tx, outbox.Message{Topic: "r30.delay", Key: "held", Type: "E", Payload: []byte(`{}`), Delay: d})
		})
		if err != nil {
			t.Errorf("InsertTx with Delay %v: %v", d, err)
		}
	}
	for _, d := range []time.Duration{time.Nanosecond, time.Microsecond} {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return ob.InsertTx(ctx, tx, outbox.Message{Topic: "r30.delay", Key: "due", Type: "E", Payload: []byte(`{}`), Delay: d})
		})
		if err != nil {
			t.Errorf("InsertTx with Delay %v: %v", d, err)
		}
	}
	time.Sleep(2 * time.Millisecond)
	w := publishAll(t, pool, schema)
	if n := w.written(); n != 2 {
		t.Errorf("the relay published %d messages, want the 2 with a delay of 1 ns and 1 µs", n)
	}
	for _, m := range w.msgs {
		if string(m.Key) != "due" {
			t.Errorf("a held message was published: key %q", m.Key)
		}
	}
	// Held rows count as pending, with an age that is not negative.
	st, err := ob.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Pending != 5 || st.OldestPendingAge < 0 {
		t.Errorf("Status = %+v, want 5 pending with a non-negative age", st)
	}
}

// TestOutboxNegativeDelayIsRefused: a negative delay is refused as invalid
// (CHANGELOG: "a negative delay ... refused"), naming the field.
func TestOutboxNegativeDelayIsRefused(t *testing.T) {
	t.Parallel()
	for _, d := range []time.Duration{-1, math.MinInt64} {
		m := outbox.Message{Topic: "r30.delay", Key: "k", Type: "E", Delay: d}
		err := m.Check()
		if !errors.Is(err, outbox.ErrInvalidMessage) || !containsFold(err.Error(), "delay") {
			t.Errorf("Check of Delay %v = %v, want ErrInvalidMessage naming Delay", d, err)
		}
	}
}

// TestDeletePublishedExtremes: DeletePublished "deletes the messages
// published longer than olderThan ago, at most batch rows per statement";
// "olderThan and batch must be positive".
func TestDeletePublishedExtremes(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	ctx := context.Background()
	ob, err := outbox.New(pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	insert(t, pool, schema, 6, outbox.Message{})
	publishAll(t, pool, schema)
	published := func() int64 {
		return count(t, pool, `SELECT count(*) FROM `+table(schema, "outbox")+` WHERE status = 'published'`)
	}
	if p := published(); p != 6 {
		t.Fatalf("%d published, want 6", p)
	}
	for _, old := range []time.Duration{37 * time.Minute, 25 * 24 * time.Hour, 30 * 24 * time.Hour, 100 * 365 * 24 * time.Hour, math.MaxInt64} {
		for _, batch := range []int{1, 1 << 31, math.MaxInt} {
			n, err := ob.DeletePublished(ctx, old, batch)
			if err != nil || n != 0 {
				t.Errorf("DeletePublished(%v, %d) = %d, %v; want 0, nil", old, batch, n, err)
			}
		}
	}
	for _, bad := range []struct {
		old   time.Duration
		batch int
	}{{0, 10}, {-1, 10}, {math.MinInt64, 10}, {time.Hour, 0}, {time.Hour, -1}, {time.Hour, math.MinInt}} {
		if n, err := ob.DeletePublished(ctx, bad.old, bad.batch); err == nil || n != 0 {
			t.Errorf("DeletePublished(%v, %d) = %d, %v; want an error (both must be positive)", bad.old, bad.batch, n, err)
		}
	}
	time.Sleep(2 * time.Millisecond)
	n, err := ob.DeletePublished(ctx, time.Microsecond, math.MaxInt)
	if err != nil || n != 6 {
		t.Errorf("DeletePublished(1µs, MaxInt) = %d, %v; want 6", n, err)
	}
}

// TestReplayMaxBounds: "a Max above ReplayMaxLimit, or a negative Max or
// RatePerSecond, is refused"; ReplayMaxLimit itself is accepted.
func TestReplayMaxBounds(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	ctx := context.Background()
	ob, err := outbox.New(pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	insert(t, pool, schema, 3, outbox.Message{})
	publishAll(t, pool, schema)
	for _, o := range []outbox.ReplayOpts{
		{Max: outbox.ReplayMaxLimit + 1}, {Max: math.MaxInt}, {Max: 1 << 31}, {Max: -1}, {Max: math.MinInt},
		{RatePerSecond: -1}, {RatePerSecond: math.Inf(-1)}, {RatePerSecond: -math.SmallestNonzeroFloat64},
	} {
		o.DryRun = true
		if res, err := ob.Replay(ctx, o); err == nil {
			t.Errorf("Replay(Max %d, Rate %v) = %+v, want a refusal", o.Max, o.RatePerSecond, res)
		}
	}
	res, err := ob.Replay(ctx, outbox.ReplayOpts{Max: outbox.ReplayMaxLimit, DryRun: true})
	if err != nil || len(res.Matched) != 3 {
		t.Errorf("Replay(Max ReplayMaxLimit, dry run) = %+v, %v; want 3 matched", res, err)
	}
}

// TestReplayRateExtremes: RatePerSecond "limits messages per second". A
// rate so small that its interval is longer than time.Duration's range
// (one message in 10^12 s) must still limit: within a second at most the
// first message goes, or the rate is refused. A NaN rate is refused or
// limits; +Inf is no limit or refused: never a hang.
func TestReplayRateExtremes(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	ob, err := outbox.New(pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	insert(t, pool, schema, 5, outbox.Message{})
	publishAll(t, pool, schema)
	for _, rate := range []float64{1e-12, math.SmallestNonzeroFloat64, math.NaN()} {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		res, err := ob.Replay(ctx, outbox.ReplayOpts{Max: 5, RatePerSecond: rate})
		cancel()
		got := int64(-1)
		if res != nil {
			got = res.Republished
		}
		if got > 1 {
			t.Errorf("Replay at %v/s republished %d messages within a second (err %v), want at most 1", rate, got, err)
		}
		// Back to published for the next case.
		publishAll(t, pool, schema)
	}
}

// TestReplayRateInfinityDoesNotHang: an infinite rate is no limit (or is
// refused), and returns.
func TestReplayRateInfinityDoesNotHang(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	ob, err := outbox.New(pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	insert(t, pool, schema, 5, outbox.Message{})
	publishAll(t, pool, schema)
	for _, rate := range []float64{math.Inf(1), math.MaxFloat64, 1e12} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		res, err := ob.Replay(ctx, outbox.ReplayOpts{Max: 5, RatePerSecond: rate})
		hung := ctx.Err() != nil
		cancel()
		if hung {
			t.Fatalf("Replay at %v/s hung: %v", rate, err)
		}
		if err == nil && res.Republished != 5 {
			t.Errorf("Replay at %v/s republished %d, want 5", rate, res.Republished)
		}
		publishAll(t, pool, schema)
	}
}

func containsFold(s, sub string) bool {
	return strings.Contains(strings.ToLower(s), strings.ToLower(sub))
}
