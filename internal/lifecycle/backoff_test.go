package lifecycle_test

import (
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
