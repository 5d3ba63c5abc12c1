package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
)

// A held command carries when it was first held, in database time; its
// grace and its growing delay are counted from then, never from a clock
// the message brought.
func TestHoldMessageCountsFromTheFirstHoldInDatabaseTime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, st, schema := newStore(t)
	row := func(id uuid.UUID) (since time.Time, delay time.Duration) {
		var text string
		require.NoError(t, pool.QueryRow(ctx, `SELECT headers->>'`+store.HeaderHeldSince+`', available_at - created_at FROM "`+schema+`".outbox WHERE id = $1`, id).
			Scan(&text, &delay))
		since, err := time.Parse(time.RFC3339Nano, text)
		require.NoError(t, err, "held-since is the database's time, not the forged header")
		return since, delay
	}
	var maxDelay time.Duration
	hold := func(since *time.Time, grace time.Duration) (bool, uuid.UUID) {
		h := &store.Held{ID: uuid.New(), Topic: "t", AggregateType: "sagaflow.held", AggregateID: "k", Type: "sagaflow.step",
			Payload: []byte("{}"), Headers: map[string]string{store.HeaderHeldSince: "forged"}, HeldSince: since,
			Delay: 20 * time.Millisecond, MaxDelay: maxDelay}
		held, delay, err := st.HoldMessage(ctx, pool, h, grace)
		require.NoError(t, err)
		if held {
			_, d := row(h.ID)
			require.Equal(t, d, delay, "the delay returned is the row's")
		}
		return held, h.ID
	}

	held, first := hold(nil, time.Minute)
	require.True(t, held)
	since, delay := row(first)
	require.Equal(t, 20*time.Millisecond, delay)

	// Held again ten minutes later (as far as the database knows): past a
	// five-minute grace it is not held; with no grace it is, with the
	// delay capped at a minute.
	long := since.Add(-10 * time.Minute)
	held, _ = hold(&long, 5*time.Minute)
	require.False(t, held)
	held, again := hold(&long, 0)
	require.True(t, held)
	since2, delay2 := row(again)
	require.Equal(t, long.UTC(), since2.UTC(), "the first hold's time is kept")
	require.Equal(t, time.Minute, delay2)
	// With a cap of its own, the delay stops there.
	maxDelay = 2 * time.Second
	held, capped := hold(&long, 0)
	require.True(t, held)
	_, delay3 := row(capped)
	require.Equal(t, 2*time.Second, delay3)
}

// A grace of days is counted as such: the grace and the delays are
// microseconds in 64 bits (a grace over 2^31 microseconds, under 36
// minutes, failed the statement).
func TestHoldMessageTakesAGraceOfDays(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, st, _ := newStore(t)
	hold := func(since *time.Time, grace time.Duration) (bool, time.Duration) {
		h := &store.Held{ID: uuid.New(), Topic: "t", AggregateType: "sagaflow.held", AggregateID: "k", Type: "sagaflow.step",
			Payload: []byte("{}"), HeldSince: since, Delay: 3 * time.Hour, MaxDelay: 48 * time.Hour}
		held, delay, err := st.HoldMessage(ctx, pool, h, grace)
		require.NoError(t, err)
		return held, delay
	}
	held, delay := hold(nil, 72*time.Hour)
	require.True(t, held)
	require.Equal(t, 3*time.Hour, delay)
	twoDays := time.Now().Add(-48 * time.Hour)
	held, delay = hold(&twoDays, 72*time.Hour)
	require.True(t, held, "held two days of a three-day grace")
	require.InDelta(t, float64(24*time.Hour), float64(delay), float64(time.Minute), "half the time held: %v", delay)
	fourDays := time.Now().Add(-96 * time.Hour)
	held, _ = hold(&fourDays, 72*time.Hour)
	require.False(t, held, "held four days of a three-day grace")
}

// A held-since forged into the future (it travels in a message header)
// counts as now: the message is held, its header says now, and the grace
// runs out as for any other. Taken as it came, it kept the message held
// (and published again every minute) past its grace, for ever.
func TestHoldMessageTakesAFutureHeldSinceAsNow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, st, schema := newStore(t)
	future := time.Now().AddDate(1, 0, 0)
	h := &store.Held{ID: uuid.New(), Topic: "t", AggregateType: "sagaflow.held", AggregateID: "k", Type: "sagaflow.step",
		Payload: []byte("{}"), HeldSince: &future, Delay: 20 * time.Millisecond}
	held, delay, err := st.HoldMessage(ctx, pool, h, 5*time.Minute)
	require.NoError(t, err)
	require.True(t, held)
	require.Equal(t, 20*time.Millisecond, delay)
	var text string
	require.NoError(t, pool.QueryRow(ctx, `SELECT headers->>'`+store.HeaderHeldSince+`' FROM "`+schema+`".outbox WHERE id = $1`, h.ID).Scan(&text))
	since, err := time.Parse(time.RFC3339Nano, text)
	require.NoError(t, err)
	require.WithinDuration(t, time.Now(), since, time.Minute, "held since now, not the forged future")
}
