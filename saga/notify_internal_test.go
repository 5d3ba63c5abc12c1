package saga

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The notifier sends the first notification after a quiet spell at once,
// and coalesces the requests that come while the next one waits: a burst
// of commits costs two notifications, not one each, and none is lost.
func TestNotifierSendsAtOnceThenCoalesces(t *testing.T) {
	sleeps := make(chan time.Duration, 10)
	wake := make(chan struct{})
	n := &notifier{sleep: func(d time.Duration) {
		sleeps <- d
		<-wake
	}}
	var sent atomic.Int32
	sends := make(chan struct{}, 100)
	send := func() {
		sent.Add(1)
		sends <- struct{}{}
	}

	n.schedule(send)
	<-sends
	require.Empty(t, sleeps, "the first notification waits for nothing")

	// The next, right after, waits out the rest of notifyCoalesce, and the
	// burst that comes meanwhile rides on it.
	n.schedule(send)
	d := <-sleeps
	require.Greater(t, d, time.Duration(0))
	require.LessOrEqual(t, d, notifyCoalesce)
	for range 100 {
		n.schedule(send)
	}
	require.Equal(t, int32(1), sent.Load(), "nothing is sent while the next waits")
	close(wake)
	<-sends
	require.Equal(t, int32(2), sent.Load())
	require.Eventually(t, func() bool { return !n.pending.Load() }, 5*time.Second, time.Millisecond)

	// A request after the send is followed by a notification of its own.
	n.schedule(send)
	<-sends
	require.Equal(t, int32(3), sent.Load())
}
