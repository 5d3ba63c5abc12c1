// Package review19_test is a black-box review, written from the
// documentation only, of issue #17's latest changes (CHANGELOG "Issue #17"):
// the look ahead of an idle engine worker and of a relay that now counts a
// command or row written for later that came due since its claim began;
// Stats.BusBatchesRerun and the batch's read ahead in Kafka mode; a Kafka
// message parsed once per run; and the doc lines on locks taken from outside
// the API (docs/reliability.md) and on the participant's refused
// compensations and invalid UTF-8 (participant/doc.go). See FINDINGS.md.
//
// Every engine and relay here polls once a minute (poll) and rescues once an
// hour, so that anything left to the poll shows as a saga or row that is not
// done within a few seconds.
package review19_test

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

// TestMain runs four tests at once unless -parallel says otherwise: the
// tests mostly wait on PostgreSQL and the broker.
func TestMain(m *testing.M) { pgtest.MainParallel(m, 4) }

const (
	// poll is every engine's and relay's PollInterval here.
	poll = time.Minute
	// within is how long what the docs say runs when due may take, at most,
	// on a loaded two-core machine under -race: far from a poll.
	within = 15 * time.Second
	// wait bounds the set-up waits (a consumer group forming).
	wait = 30 * time.Second
)

type ord struct {
	ID  string `json:"id"`
	Tag string `json:"tag,omitempty"`
}

// config is d's engine configuration: a one-minute poll, an hourly rescuer.
func config(d *testkit.DB, workers, batch int) *saga.Config {
	c := d.PatientConfig(workers)
	c.BatchSize = batch
	return c
}

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

// calls counts handler calls per key, with the transaction id of each.
type calls struct {
	mu  sync.Mutex
	n   map[string]int
	txs map[string][]string // key -> txids
}

func (c *calls) add(k, txid string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n, c.txs = map[string]int{}, map[string][]string{}
	}
	c.n[k]++
	c.txs[k] = append(c.txs[k], txid)
	return c.n[k]
}

func (c *calls) get(k string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[k]
}

// shared lists the transactions in which handlers of at least two different
// keys ran, with those keys.
func (c *calls) shared() map[string][]string {
	c.mu.Lock()
	defer c.mu.Unlock()
	by := map[string]map[string]bool{}
	for k, txs := range c.txs {
		for _, tx := range txs {
			if by[tx] == nil {
				by[tx] = map[string]bool{}
			}
			by[tx][k] = true
		}
	}
	out := map[string][]string{}
	for tx, ks := range by {
		if len(ks) > 1 {
			for k := range ks {
				out[tx] = append(out[tx], k)
			}
		}
	}
	return out
}

// txid is the current transaction's id (one is assigned if none was).
func txid(ctx context.Context, run *saga.StepRun) (string, error) {
	var s string
	err := run.Tx.QueryRow(ctx, "SELECT pg_current_xact_id()::text").Scan(&s)
	return s, err
}

type errFlaky struct{ n int }

func (e errFlaky) Error() string { return fmt.Sprintf("review19: flaky, run %d", e.n) }
