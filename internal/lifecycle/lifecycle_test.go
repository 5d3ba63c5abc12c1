package lifecycle_test

import (
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/sagaflow/sagaflow/internal/lifecycle"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// worker takes "work" until fetch ends and finishes the item in flight
// unless work ends first.
func launch(running, finished, abandoned *atomic.Int32, item time.Duration) func(fetch, work context.Context, wg *sync.WaitGroup) {
	return func(fetch, work context.Context, wg *sync.WaitGroup) {
		wg.Go(func() {
			for fetch.Err() == nil {
				running.Add(1)
				select {
				case <-time.After(item):
					finished.Add(1)
				case <-work.Done():
					abandoned.Add(1)
				}
				running.Add(-1)
			}
		})
	}
}

func TestSoftStopFinishesTheWorkInFlight(t *testing.T) {
	var l lifecycle.Lifecycle
	var running, finished, abandoned atomic.Int32
	started, err := l.Start(context.Background(), launch(&running, &finished, &abandoned, 50*time.Millisecond))
	require.NoError(t, err)
	require.True(t, started)
	require.True(t, l.Running())
	again, err := l.Start(context.Background(), launch(&running, &finished, &abandoned, time.Hour))
	require.NoError(t, err)
	require.False(t, again, "a running lifecycle does not start twice")
	for running.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	stopped, err := l.Stop(context.Background(), false)
	require.NoError(t, err)
	require.True(t, stopped)
	require.False(t, l.Running())
	require.Equal(t, int32(1), finished.Load())
	require.Zero(t, abandoned.Load())
	stopped, err = l.Stop(context.Background(), false)
	require.NoError(t, err)
	require.False(t, stopped, "stopping a stopped lifecycle does nothing")
}

func TestStopDeadlineAndHardStopAbandonTheWorkInFlight(t *testing.T) {
	var l lifecycle.Lifecycle
	var running, finished, abandoned atomic.Int32
	_, err := l.Start(context.Background(), launch(&running, &finished, &abandoned, time.Hour))
	require.NoError(t, err)
	for running.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	stopped, err := l.Stop(ctx, false)
	require.True(t, stopped)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Equal(t, int32(1), abandoned.Load())

	_, err = l.Start(context.Background(), launch(&running, &finished, &abandoned, time.Hour))
	require.NoError(t, err, "a stopped lifecycle starts again")
	for running.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	_, err = l.Stop(context.Background(), true)
	require.NoError(t, err)
	require.Equal(t, int32(2), abandoned.Load())
	require.Zero(t, finished.Load())
}

func TestStartWhileStoppingAndConcurrentCalls(t *testing.T) {
	var l lifecycle.Lifecycle
	var running, finished, abandoned atomic.Int32
	var stoppingSeen atomic.Bool
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 50 {
				if rand.N(2) == 0 {
					if _, err := l.Start(context.Background(), launch(&running, &finished, &abandoned, time.Millisecond)); err != nil {
						require.ErrorIs(t, err, lifecycle.ErrStopping)
						stoppingSeen.Store(true)
					}
				} else {
					_, err := l.Stop(context.Background(), rand.N(2) == 0)
					require.NoError(t, err)
				}
			}
		})
	}
	wg.Wait()
	_, err := l.Stop(context.Background(), false)
	require.NoError(t, err)
	require.False(t, l.Running())
	require.Zero(t, running.Load())
	t.Logf("a start during a stop was refused: %v", stoppingSeen.Load())
}
