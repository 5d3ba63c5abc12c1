package lifecycle

import (
	"context"
	"log/slog"
	"math"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Sleep waits d, or until ctx ends; it reports whether the full d passed.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// Backoff is the pause after the given number of consecutive failures of a
// background loop: from 100ms, doubling, at most about 3s, with jitter.
func Backoff(failures int) time.Duration {
	d := 50 * time.Millisecond << min(failures, 6)
	return min(d, 3*time.Second) + rand.N(50*time.Millisecond)
}

// Listen calls wake with the payload of every notification on channel,
// and with the empty payload each time it (re)connects (whatever was
// announced while no one listened), until ctx ends; connected is true while
// the LISTEN is in place. When the listening connection fails it logs,
// waits a second or two and connects again; the caller keeps polling
// meanwhile. The connection is taken from pool and never returned to it: a
// listening connection would receive notifications meant for nobody.
func Listen(ctx context.Context, pool *pgxpool.Pool, channel string, log *slog.Logger, what string, wake func(payload string),
	connected *atomic.Bool) {
	defer connected.Store(false)
	for ctx.Err() == nil {
		err := listenOnce(ctx, pool, channel, func(payload string) {
			if payload == "" {
				connected.Store(true)
			}
			wake(payload)
		})
		connected.Store(false)
		if ctx.Err() != nil {
			return
		}
		log.WarnContext(ctx, "sagaflow "+what+" listener lost its connection; polling until it is back",
			slog.String("channel", channel), slog.Any("error", err))
		if !Sleep(ctx, time.Second+rand.N(time.Second)) {
			return
		}
	}
}

func listenOnce(ctx context.Context, pool *pgxpool.Pool, channel string, wake func(string)) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	raw := conn.Hijack()
	defer raw.Close(context.WithoutCancel(ctx))
	if _, err := raw.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		return err
	}
	wake("")
	for {
		n, err := raw.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		wake(n.Payload)
	}
}

// Exponential is initial doubled for every attempt after the first (attempt
// 1 gets initial), at most maxDelay: the one backoff curve of sagaflow's
// retries (steps, relay rows, inbox consumers).
func Exponential(initial, maxDelay time.Duration, attempt int) time.Duration {
	d := max(initial, 0)
	// At most 63 doublings: a delay past half the cap is the cap (doubling
	// it could wrap past the longest duration, to 0 or below), and a zero
	// delay stays zero however high the attempt.
	for i := 1; i < attempt && d > 0 && d < maxDelay; i++ {
		if d > maxDelay/2 {
			return maxDelay
		}
		d *= 2
	}
	return min(d, maxDelay)
}

// Jitter moves d by a random fraction of it between lo and hi (e.g. -0.2
// and 0.2), so that retries that failed together do not come back
// together; never below zero.
func Jitter(d time.Duration, lo, hi float64) time.Duration {
	j := float64(d) * (1 + lo + rand.Float64()*(hi-lo))
	switch {
	case j >= math.MaxInt64: // past the longest duration, which it stays
		return math.MaxInt64
	case j <= 0:
		return 0
	}
	return time.Duration(j)
}
