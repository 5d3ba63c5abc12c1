package review30_test

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
)

// attempts are the attempt numbers tried on the backoff functions: the
// first ones, the ones where doubling a second passes time.Duration's
// range (2^34 s), and int's extremes.
var attempts = []int{1, 2, 3, 10, 20, 33, 34, 35, 40, 62, 63, 64, 65, 100, 1000, 1 << 20, 1 << 31, math.MaxInt32, math.MaxInt64 - 1, math.MaxInt64}

// TestSagaDefaultBackoffStaysInItsBounds: DefaultBackoff "is exponential
// from 1s to 5m with jitter" (up to 20% either way), for any attempt.
func TestSagaDefaultBackoffStaysInItsBounds(t *testing.T) {
	t.Parallel()
	lo, hi := time.Duration(0.8*float64(saga.BackoffInitialDefault)), time.Duration(1.2*float64(saga.BackoffMaxDefault))
	for _, a := range attempts {
		for range 50 {
			if d := saga.DefaultBackoff(a); d < lo || d > hi {
				t.Fatalf("DefaultBackoff(%d) = %v, want within [%v, %v]", a, d, lo, hi)
			}
		}
	}
}

// TestSagaExponentialBackoffAtTheLongestDuration: ExponentialBackoff
// "doubles from initial up to maxDelay, with up to 20% random jitter either
// way". With the longest durations (a step that should wait "forever"
// between attempts, a cap of "none") the wait must stay at least initial
// less 20%: a doubling or a jitter that overflows gives 0, a retry at once.
func TestSagaExponentialBackoffAtTheLongestDuration(t *testing.T) {
	t.Parallel()
	cases := []struct{ initial, max time.Duration }{
		{math.MaxInt64, math.MaxInt64},                    // wait "forever": 0 s about half the time
		{time.Hour, math.MaxInt64},                        // "no cap": 0 s from the 30th attempt
		{time.Second, 250 * 365 * 24 * time.Hour},         // a cap of 250 years: 0 s from the 34th attempt
		{30 * 24 * time.Hour, 200 * 365 * 24 * time.Hour}, // holds
	}
	var bad []string
	for _, c := range cases {
		b := saga.ExponentialBackoff(c.initial, c.max)
		for _, a := range []int{1, 2, 3, 10, 20, 30, 34, 35, 40, 63, 64, 65, 100, 1000} {
			for range 50 {
				if d := b(a); d < time.Duration(0.8*float64(c.initial)) {
					bad = append(bad, fmt.Sprintf("ExponentialBackoff(%v, %v)(%d) = %v", c.initial, c.max, a, d))
					break
				}
			}
		}
	}
	if len(bad) > 0 {
		t.Fatalf("waits shorter than initial less 20%% (a retry at once):\n%s", strings.Join(bad, "\n"))
	}
}

// TestRelayDefaultBackoffStaysInItsBounds: relay.DefaultBackoff "doubles
// from one second after the first failure to five minutes, with ±20%
// jitter".
func TestRelayDefaultBackoffStaysInItsBounds(t *testing.T) {
	t.Parallel()
	lo, hi := time.Duration(0.8*float64(relay.BackoffMinDefault)), time.Duration(1.2*float64(relay.BackoffMaxDefault))
	for _, a := range attempts {
		for range 50 {
			if d := relay.DefaultBackoff(a); d < lo || d > hi {
				t.Fatalf("relay.DefaultBackoff(%d) = %v, want within [%v, %v]", a, d, lo, hi)
			}
		}
	}
}
