package main

import (
	"math"
	"testing"
	"time"
)

func TestSummarize(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   []float64
		want Stat
	}{
		{"none", nil, Stat{}},
		{"one", []float64{4}, Stat{Median: 4, Min: 4, Max: 4, N: 1}},
		{"odd, unsorted", []float64{30, 10, 20}, Stat{Median: 20, Min: 10, Max: 30, Spread: 1, N: 3}},
		{"even", []float64{1, 4, 2, 3}, Stat{Median: 2.5, Min: 1, Max: 4, Spread: 1.2, N: 4}},
		{"NaN ignored", []float64{math.NaN(), 5, 5}, Stat{Median: 5, Min: 5, Max: 5, N: 2}},
		{"zero median", []float64{0, 0, 0}, Stat{N: 3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := summarize(tc.in)
			if math.Abs(got.Spread-tc.want.Spread) > 1e-9 {
				t.Fatalf("spread: got %v, want %v", got.Spread, tc.want.Spread)
			}
			got.Spread = tc.want.Spread
			if got != tc.want {
				t.Fatalf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestSummarizeDoesNotReorderItsInput(t *testing.T) {
	in := []float64{3, 1, 2}
	summarize(in)
	if in[0] != 3 || in[1] != 1 || in[2] != 2 {
		t.Fatalf("input changed: %v", in)
	}
}

func TestPercentile(t *testing.T) {
	var hundred []time.Duration
	for i := 1; i <= 100; i++ {
		hundred = append(hundred, time.Duration(i)*time.Millisecond)
	}
	for _, tc := range []struct {
		name string
		in   []time.Duration
		p    float64
		want time.Duration
	}{
		{"empty", nil, 0.5, 0},
		{"one", []time.Duration{7}, 0.99, 7},
		{"p50 of 100", hundred, 0.50, 50 * time.Millisecond},
		{"p99 of 100", hundred, 0.99, 99 * time.Millisecond},
		{"p100 of 100", hundred, 1, 100 * time.Millisecond},
		{"p1 of 100", hundred, 0.01, time.Millisecond},
		{"p50 of 3", []time.Duration{1, 2, 3}, 0.5, 2},
		{"p99 of 3", []time.Duration{1, 2, 3}, 0.99, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := percentile(tc.in, tc.p); got != tc.want {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
		})
	}
}

func TestNumAndRange(t *testing.T) {
	for _, tc := range []struct {
		v    float64
		prec int
		want string
	}{
		{0, 0, "0"}, {999, 0, "999"}, {1000, 0, "1,000"}, {1234567.891, 1, "1,234,567.9"}, {-4321, 0, "-4,321"},
	} {
		if got := num(tc.v, tc.prec); got != tc.want {
			t.Errorf("num(%v, %d) = %q, want %q", tc.v, tc.prec, got, tc.want)
		}
	}
	if got := rng(Stat{Median: 4012, Min: 3900, Max: 4100, N: 3}, 0); got != "4,012 (3,900–4,100)" {
		t.Errorf("rng: %q", got)
	}
	if got := rng(Stat{Median: 7, Min: 7, Max: 7, N: 1}, 0); got != "7" {
		t.Errorf("rng of one run: %q", got)
	}
	if got := rng(Stat{}, 0); got != "–" {
		t.Errorf("rng of none: %q", got)
	}
}
