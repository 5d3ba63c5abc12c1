package pace_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pace"
)

var limits = pace.Limits{MaxDefault: 10, MaxLimit: 100, RateDefault: 5}

func TestNormaliseRefusesWhatIsNoRate(t *testing.T) {
	for _, rate := range []float64{-1, math.Inf(-1), math.NaN()} {
		n, r := 1, rate
		err := pace.Normalise("op", limits, &n, &r)
		require.Error(t, err, "rate %v", rate)
		require.Contains(t, err.Error(), "RatePerSecond")
	}
	n, r := 0, 0.0
	require.NoError(t, pace.Normalise("op", limits, &n, &r))
	require.Equal(t, 10, n)
	require.Equal(t, 5.0, r)
}

// A rate so small that its interval is past the longest duration lets the
// first call through and then waits (it wrapped to a negative interval: no
// limit at all; review30 F3); an infinite rate is no limit.
func TestEachAtTheExtremesOfTheRate(t *testing.T) {
	for _, rate := range []float64{1e-12, math.SmallestNonzeroFloat64, 1e-9} {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		calls := 0
		err := pace.Each(ctx, 5, rate, func(int) error { calls++; return nil })
		cancel()
		require.True(t, errors.Is(err, context.DeadlineExceeded), "rate %v: %v", rate, err)
		require.Equal(t, 1, calls, "rate %v", rate)
	}
	calls := 0
	require.NoError(t, pace.Each(context.Background(), 1000, math.Inf(1), func(int) error { calls++; return nil }))
	require.Equal(t, 1000, calls)
}
