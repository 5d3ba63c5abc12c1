package review11_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"time"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

type order struct {
	ID string `json:"id"`
}

// behave lets a test steer a branch's attempts: fail returns the error of
// the n-th attempt (nil for success), block holds an attempt until the test
// releases it.
type behave struct {
	mu      sync.Mutex
	fail    map[string]func(attempt int) error
	entered map[string]chan struct{}
	release map[string]chan struct{}
}

func newBehave() *behave {
	return &behave{fail: map[string]func(int) error{}, entered: map[string]chan struct{}{}, release: map[string]chan struct{}{}}
}

// failWith makes branch key (e.g. "fan.a") fail its attempts as f says.
func (b *behave) failWith(key string, f func(attempt int) error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.fail[key] = f
}

// block makes the next attempt of branch key wait, once it has started,
// until the returned release is called; entered is closed once it started.
func (b *behave) block(key string) (entered <-chan struct{}, release func()) {
	b.mu.Lock()
	defer b.mu.Unlock()
	en, rel := make(chan struct{}), make(chan struct{})
	b.entered[key], b.release[key] = en, rel
	var once sync.Once
	return en, func() { once.Do(func() { close(rel) }) }
}

func (b *behave) enter(ctx context.Context, key string, attempt int) error {
	b.mu.Lock()
	en, rel := b.entered[key], b.release[key]
	delete(b.entered, key)
	delete(b.release, key)
	f := b.fail[key]
	b.mu.Unlock()
	if en != nil {
		close(en)
		select {
		case <-rel:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if f != nil {
		return f(attempt)
	}
	return nil
}

// fanDef is "pre" (compensated), then the parallel step "fan" with the
// given branches, each recording "<fan>.<branch>" as its effect and
// "undo:<fan>.<branch>" as its compensation, then "post". Branch attempts
// are bounded by maxAttempts, with a backoff of 10 ms.
func fanDef(name string, fx *testkit.Effects, bh *behave, maxAttempts int, branches ...string) *saga.Definition[order] {
	return fanDefWith(name, fx, bh, &saga.RetryPolicy{MaxAttempts: maxAttempts, Backoff: func(int) time.Duration { return 10 * time.Millisecond }}, branches...)
}

// fanDefWith is fanDef with the branches' retry policy given.
func fanDefWith(name string, fx *testkit.Effects, bh *behave, retry *saga.RetryPolicy, branches ...string) *saga.Definition[order] {
	return saga.Define(name,
		saga.Step[order]{Name: "pre",
			Action:     func(ctx context.Context, run *saga.StepRun, _ *order) error { return fx.Record(ctx, run, "pre") },
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *order) error { return fx.Record(ctx, run, "undo:pre") }},
		saga.Step[order]{Name: "fan", Parallel: &saga.Parallel[order]{Branches: branchesOf("fan", fx, bh, retry, branches...)}},
		saga.Step[order]{Name: "post",
			Action: func(ctx context.Context, run *saga.StepRun, _ *order) error { return fx.Record(ctx, run, "post") }},
	)
}

func branchesOf(step string, fx *testkit.Effects, bh *behave, retry *saga.RetryPolicy, names ...string) []saga.Branch[order] {
	var out []saga.Branch[order]
	for _, n := range names {
		key := step + "." + n
		out = append(out, saga.Branch[order]{Name: n,
			Retry:   retry,
			Timeout: 10 * time.Second,
			Action: func(ctx context.Context, run *saga.StepRun, _ order) (any, error) {
				if err := bh.enter(ctx, key, run.Attempt); err != nil {
					return nil, err
				}
				return map[string]int{"attempt": run.Attempt}, fx.Record(ctx, run, key)
			},
			Compensate: func(ctx context.Context, run *saga.StepRun, _ order, _ json.RawMessage) error {
				return fx.Record(ctx, run, "undo:"+key)
			}})
	}
	return out
}

var errTransient = errors.New("transient")
