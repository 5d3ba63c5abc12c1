// Package pace holds the caps and the rate limit shared by the operator's
// bulk actions: bulk saga replay and outbox replay.
package pace

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/sagaflow/sagaflow/internal/lifecycle"
)

// Limits are a bulk action's cap and rate: the defaults for zero values and
// the largest cap.
type Limits struct {
	MaxDefault, MaxLimit int
	RateDefault          float64
}

// Normalise checks a cap and a rate given by a caller of what, and fills in
// the defaults for zero values.
func Normalise(what string, l Limits, maxN *int, rate *float64) error {
	switch {
	case *maxN < 0 || *maxN > l.MaxLimit:
		return fmt.Errorf("%s: Max %d is outside 0..%d", what, *maxN, l.MaxLimit)
	case *rate < 0:
		return fmt.Errorf("%s: RatePerSecond %g is negative", what, *rate)
	case math.IsNaN(*rate):
		return fmt.Errorf("%s: RatePerSecond is NaN", what)
	}
	if *maxN == 0 {
		*maxN = l.MaxDefault
	}
	if *rate == 0 {
		*rate = l.RateDefault
	}
	return nil
}

// Each calls f for 0..n-1, at most rate calls per second, stopping early
// when ctx ends. An infinite rate is no limit; a rate so small that its
// interval is past the longest duration waits the longest duration.
func Each(ctx context.Context, n int, rate float64, f func(i int) error) error {
	interval := time.Duration(math.MaxInt64)
	// A float past int64's range converts to an arbitrary value (on amd64
	// the smallest int64, a negative interval: no limit at all).
	if iv := float64(time.Second) / rate; iv < math.MaxInt64 {
		interval = time.Duration(iv)
	}
	next := time.Now()
	for i := range n {
		if wait := time.Until(next); wait > 0 {
			if !lifecycle.Sleep(ctx, wait) {
				return ctx.Err()
			}
		}
		next = next.Add(interval)
		if err := f(i); err != nil {
			return err
		}
	}
	return nil
}
