package main

import (
	"math"
	"slices"
	"time"
)

// Stat summarises one figure over the repetitions of a measurement.
type Stat struct {
	Median float64 `json:"median"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
	// Spread is (Max - Min) / Median: how far apart the repetitions were,
	// relative to their median. 0 for a single repetition.
	Spread float64 `json:"spread"`
	N      int     `json:"n"`
}

// summarize returns the median, extremes and spread of xs, ignoring NaNs.
// The zero Stat stands for no values.
func summarize(xs []float64) Stat {
	vals := make([]float64, 0, len(xs))
	for _, x := range xs {
		if !math.IsNaN(x) {
			vals = append(vals, x)
		}
	}
	if len(vals) == 0 {
		return Stat{}
	}
	slices.Sort(vals)
	s := Stat{Median: median(vals), Min: vals[0], Max: vals[len(vals)-1], N: len(vals)}
	if s.Median != 0 {
		s.Spread = (s.Max - s.Min) / math.Abs(s.Median)
	}
	return s
}

// median returns the median of sorted values: the middle one, or the mean
// of the two middle ones. NaN for none.
func median(sorted []float64) float64 {
	n := len(sorted)
	switch {
	case n == 0:
		return math.NaN()
	case n%2 == 1:
		return sorted[n/2]
	default:
		return (sorted[n/2-1] + sorted[n/2]) / 2
	}
}

// percentile returns the nearest-rank p-th percentile (0 < p <= 1) of
// sorted durations: the smallest value with at least p of the samples at or
// below it. 0 for none.
func percentile(sorted []time.Duration, p float64) time.Duration {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	rank := int(math.Ceil(p*float64(n))) - 1
	return sorted[min(max(rank, 0), n-1)]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
