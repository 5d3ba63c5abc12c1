// Package lifecycle gives sagaflow's long-running parts (the engine, the
// relay) one start/stop discipline: Start returns at once; Stop stops taking
// new work, lets the work in flight finish and returns when every goroutine
// has exited, or, when its context ends first, cancels the work in flight,
// waits for the goroutines and returns the context's error; a hard stop
// cancels at once. Start and Stop are safe to call repeatedly and
// concurrently, and a stopped part can be started again.
package lifecycle

import (
	"context"
	"errors"
	"sync"
)

// ErrStopping is returned by [Lifecycle.Start] while a stop is under way.
var ErrStopping = errors.New("stopping; wait for Stop to return before starting again")

// Lifecycle runs one set of goroutines at a time. The zero value is ready.
type Lifecycle struct {
	mu  sync.Mutex
	run *run
}

type run struct {
	stopping    bool
	fetchCancel context.CancelFunc
	workCancel  context.CancelFunc
	done        chan struct{}
}

// Start launches the goroutines unless they run already (then it reports
// false). launch starts them with wg.Go: they must stop taking new work when
// fetch ends and abandon the work in flight when work ends; fetch ends
// first. Cancelling ctx is a hard stop.
func (l *Lifecycle) Start(ctx context.Context, launch func(fetch, work context.Context, wg *sync.WaitGroup)) (bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.run != nil {
		if l.run.stopping {
			return false, ErrStopping
		}
		return false, nil
	}
	work, workCancel := context.WithCancel(ctx)
	fetch, fetchCancel := context.WithCancel(work)
	r := &run{fetchCancel: fetchCancel, workCancel: workCancel, done: make(chan struct{})}
	l.run = r
	var wg sync.WaitGroup
	launch(fetch, work, &wg)
	go func() {
		wg.Wait()
		workCancel()
		l.mu.Lock()
		l.run = nil
		l.mu.Unlock()
		close(r.done)
	}()
	return true, nil
}

// Stop stops the goroutines, softly or (hard) at once, as the package doc
// says. It reports whether they were running.
func (l *Lifecycle) Stop(ctx context.Context, hard bool) (bool, error) {
	l.mu.Lock()
	r := l.run
	if r == nil {
		l.mu.Unlock()
		return false, nil
	}
	r.stopping = true
	r.fetchCancel()
	if hard {
		r.workCancel()
	}
	l.mu.Unlock()
	select {
	case <-r.done:
		return true, nil
	case <-ctx.Done():
		r.workCancel()
		<-r.done
		return true, ctx.Err()
	}
}

// Running reports whether the goroutines run and no stop is under way.
func (l *Lifecycle) Running() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.run != nil && !l.run.stopping
}
