package testkit

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
)

// Buffer is an io.Writer that goroutines may write to while a test reads
// it (a logger's or a command's output).
type Buffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *Buffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String returns what was written so far.
func (l *Buffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Gate holds handlers until it is opened: a test makes a step wait in its
// handler while it does something else, then lets it go. Opening twice is
// harmless, so a test opens its gates in a cleanup too, and a failed
// assertion never leaves a handler waiting.
type Gate struct {
	ch      chan struct{}
	once    sync.Once
	entered atomic.Int32
	left    atomic.Int32
}

// NewGate returns a closed gate.
func NewGate() *Gate { return &Gate{ch: make(chan struct{})} }

// Open lets every handler through, now and later.
func (g *Gate) Open() { g.once.Do(func() { close(g.ch) }) }

// Entered is how many handlers have reached the gate.
func (g *Gate) Entered() int { return int(g.entered.Load()) }

// Left is how many handlers left the gate because their context ended
// (their step's timeout, a cancel), not because the gate opened.
func (g *Gate) Left() int { return int(g.left.Load()) }

// Pass waits until the gate is open or ctx ends, and returns ctx's error
// then.
func (g *Gate) Pass(ctx context.Context) error {
	g.entered.Add(1)
	select {
	case <-g.ch:
		return nil
	case <-ctx.Done():
		g.left.Add(1)
		return ctx.Err()
	}
}

// Stragglers counts handlers that outlive their step on purpose (ones that
// ignore their context and are abandoned or given up), so that a test waits
// for them before its cleanups take away what they read. A bare
// sync.WaitGroup will not do: a handler's Add at a zero count may come while
// a cleanup already waits, which WaitGroup forbids and the race detector
// reports, failing every test that runs at that moment.
//
//	var late testkit.Stragglers
//	t.Cleanup(late.Wait)
//	... Action: func(ctx context.Context, run *saga.StepRun, o *order) error {
//		defer late.Enter()()
//		time.Sleep(time.Second) // ignores ctx
//		return nil
//	}
type Stragglers struct {
	mu sync.Mutex
	wg sync.WaitGroup
}

// Enter counts one straggler and returns the function that ends it.
func (s *Stragglers) Enter() (leave func()) {
	s.mu.Lock()
	s.wg.Add(1)
	s.mu.Unlock()
	return s.wg.Done
}

// Wait returns when every straggler counted so far has ended. One that
// enters while Wait runs is held at Enter until Wait returns.
func (s *Stragglers) Wait() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.wg.Wait()
}

// Counter counts calls per key (a saga, a step), for handlers to count
// their runs.
type Counter struct{ m sync.Map }

// Add counts one more for k and returns the count.
func (c *Counter) Add(k string) int32 {
	n, _ := c.m.LoadOrStore(k, new(atomic.Int32))
	return n.(*atomic.Int32).Add(1)
}

// Get is k's count.
func (c *Counter) Get(k string) int32 {
	n, ok := c.m.Load(k)
	if !ok {
		return 0
	}
	return n.(*atomic.Int32).Load()
}
