package lifecycle_test

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/lifecycle"
)

func TestExponentialDoublesUpToItsCap(t *testing.T) {
	for attempt, want := range map[int]time.Duration{
		-1: time.Second, 0: time.Second, 1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second,
		9: 256 * time.Second, 10: 5 * time.Minute, 1 << 30: 5 * time.Minute,
	} {
		require.Equal(t, want, lifecycle.Exponential(time.Second, 5*time.Minute, attempt), "attempt %d", attempt)
	}
}

func TestJitterStaysInItsBand(t *testing.T) {
	spread := map[time.Duration]bool{}
	for range 1000 {
		d := lifecycle.Jitter(10*time.Second, -0.2, 0.2)
		require.GreaterOrEqual(t, d, 8*time.Second)
		require.LessOrEqual(t, d, 12*time.Second)
		spread[d/time.Second] = true
		up := lifecycle.Jitter(10*time.Second, 0, 0.2)
		require.GreaterOrEqual(t, up, 10*time.Second)
		require.LessOrEqual(t, up, 12*time.Second)
	}
	require.Greater(t, len(spread), 2, "the jitter spreads")
	require.Equal(t, time.Duration(0), lifecycle.Jitter(0, -0.2, 0.2))
	require.GreaterOrEqual(t, lifecycle.Jitter(time.Second, -2, -1.5), time.Duration(0), "never below zero")
}

// At the longest durations the doubling and the jitter stop at the cap (or
// the longest duration) instead of wrapping to zero, an immediate retry
// (review30 F1, F2); and a huge attempt number costs no more than a small
// one.
func TestBackoffAtTheLongestDurations(t *testing.T) {
	const longest = time.Duration(math.MaxInt64)
	for _, c := range []struct {
		initial, maxDelay time.Duration
		attempt           int
		want              time.Duration
	}{
		{time.Hour, longest, 22, time.Hour << 21},
		{time.Hour, longest, 23, longest},
		{time.Hour, longest, 60, longest},
		{time.Hour, longest, math.MaxInt, longest},
		{longest, longest, 1, longest},
		{longest, longest, math.MaxInt, longest},
		{time.Hour, 250 * 365 * 24 * time.Hour, 40, 250 * 365 * 24 * time.Hour},
		{0, time.Hour, math.MaxInt, 0},
		{time.Nanosecond, longest, math.MaxInt, longest},
	} {
		got := lifecycle.Exponential(c.initial, c.maxDelay, c.attempt)
		require.Equal(t, c.want, got, "Exponential(%v, %v, %d)", c.initial, c.maxDelay, c.attempt)
	}
	for range 1000 {
		require.Equal(t, longest, lifecycle.Jitter(longest, 0, 0.2), "past the longest is the longest")
		d := lifecycle.Jitter(longest, -0.2, 0.2)
		require.GreaterOrEqual(t, d, longest/10*8, "the jitter of the longest stays in its band")
		d = lifecycle.Jitter(longest/2, 0, 0.2)
		require.GreaterOrEqual(t, d, longest/2)
	}
}
