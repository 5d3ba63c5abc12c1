// Package review17 is a black-box review, written from the documentation
// only (README, CHANGELOG #17, docs/architecture.md "Wake-ups come after
// the commit", saga/doc.go and the exported API), of the wake-up of a
// worker when a direct command written for later comes due: a retry after
// its backoff, a command deferred because another transaction held its
// saga, the retry of a step run after a reply in the hybrid mode, and, in
// Kafka mode, a command moved back to the outbox because its saga was busy.
//
// Every engine and relay here polls once a minute (poll) and rescues once
// an hour, so that anything left to the poll shows as a saga that does not
// end within a few seconds. See FINDINGS.md.
package review17

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

const (
	// poll is every engine's and relay's PollInterval: what is left to it
	// does not happen within a test.
	poll = time.Minute
	// prompt is how long after it is due a woken command may take, at
	// most, to have run (generous for -race on two cores).
	prompt = 4 * time.Second
	// late is how long after it was due a retry or timer may run: a poll
	// would be a minute, so a loaded CI run gets room without the bound
	// letting a poll through.
	lateBy = 3 * time.Second
)

// slots bounds the tests that run at once, to keep PostgreSQL connections
// modest (each schema's pool has at most 12).
var slots = make(chan struct{}, 3)

// parallel marks t parallel and waits for a slot.
func parallel(t *testing.T) {
	t.Helper()
	t.Parallel()
	slots <- struct{}{}
	t.Cleanup(func() { <-slots })
}

type ord struct {
	ID  string `json:"id"`
	Tag string `json:"tag,omitempty"`
}

// config is d's engine configuration with a one-minute poll, an hourly
// rescuer and workers workers.
func config(d *testkit.DB, workers int) *saga.Config {
	return d.PatientConfig(workers)
}

// backoff is a constant backoff of d.
func backoff(n int, d time.Duration) *saga.RetryPolicy {
	return testkit.ConstantBackoff(n, d)
}

// endedWithin waits at most d for saga id to end, and fails the test with
// its timeline if it does not.
func endedWithin(t *testing.T, e *saga.Engine, id uuid.UUID, d time.Duration) *saga.Instance {
	t.Helper()
	return sagatest.WaitEnded(t, e, id, &sagatest.WaitOpts{Timeout: d})
}

func get(t *testing.T, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	in, err := e.Get(context.Background(), id)
	require.NoError(t, err)
	return in
}

// timeline and count read a saga's history (see testkit.Timeline and
// testkit.Events).
var (
	timeline = testkit.Timeline
	count    = testkit.Events
)

// runs records every run of a step per saga, with its start time.
type runs struct {
	mu sync.Mutex
	at map[string][]time.Time
}

func (r *runs) add(k string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.at == nil {
		r.at = map[string][]time.Time{}
	}
	r.at[k] = append(r.at[k], time.Now())
	return len(r.at[k])
}

func (r *runs) n(k string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.at[k])
}

func (r *runs) times(k string) []time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]time.Time(nil), r.at[k]...)
}

// gaps are the times between consecutive runs of k.
func (r *runs) gaps(k string) []time.Duration {
	ts := r.times(k)
	var out []time.Duration
	for i := 1; i < len(ts); i++ {
		out = append(out, ts[i].Sub(ts[i-1]))
	}
	return out
}

type errFlaky struct{ n int }

func (e errFlaky) Error() string { return fmt.Sprintf("flaky, run %d", e.n) }

// flaky is an action that fails its first fails(o) runs for saga o, and
// then records tag in the step's transaction.
func flaky(fx *testkit.Effects, r *runs, tag string, fails func(o *ord) int) saga.StepFunc[ord] {
	return func(ctx context.Context, run *saga.StepRun, o *ord) error {
		n := r.add(o.ID + "/" + tag)
		if n <= fails(o) {
			return errFlaky{n}
		}
		return fx.Record(ctx, run, tag)
	}
}

func rec(fx *testkit.Effects, tag string) saga.StepFunc[ord] {
	return func(ctx context.Context, run *saga.StepRun, _ *ord) error { return fx.Record(ctx, run, tag) }
}

// longRelay starts a relay on d's schema with a one-minute poll, until the
// test ends.
func longRelay(t *testing.T, brokers []string, d *testkit.DB) {
	t.Helper()
	testkit.RelayPolling(t, brokers, d, poll)
}

// counter counts calls per key (see testkit.Counter).
type counter = testkit.Counter
