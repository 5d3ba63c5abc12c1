package saga

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sagaflow/sagaflow/health"
	"github.com/sagaflow/sagaflow/internal/consume"
	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/migrations"
)

// healthState is what the engine's goroutines tell [Engine.Health].
type healthState struct {
	workers   atomic.Int32 // executor goroutines running
	listening atomic.Bool  // the LISTEN connection is in place

	mu        sync.Mutex
	claimAt   time.Time // of the last claim, successful or not
	claimErr  error     // of the last claim; nil when it succeeded
	claimSeen bool

	fetches consume.FetchHealth // of the engine's Kafka readers
}

func (h *healthState) workerUp()   { h.workers.Add(1) }
func (h *healthState) workerDown() { h.workers.Add(-1) }

// claimed records the outcome of a worker's claim.
func (h *healthState) claimed(err error) {
	h.mu.Lock()
	h.claimAt, h.claimErr, h.claimSeen = time.Now(), err, true
	h.mu.Unlock()
}

// expectedWorkers is how many executor goroutines a running engine has.
func (e *Engine) expectedWorkers() int {
	return e.kafkaReaders() + e.directWorkers()
}

// directWorkers is how many workers claim commands from the outbox table:
// Config.Workers, but in Kafka mode only one, for the replays and cancel
// requests that a tool without the saga's definition (the operator CLI)
// records as direct commands.
func (e *Engine) directWorkers() int {
	if e.allKafka() {
		return 1
	}
	return e.cfg.Workers
}

// Health reports the engine's health (see package health): the schema has
// every migration this build needs, the engine runs with all its workers,
// the last claim of commands succeeded, no fetch from Kafka failed in the
// last 30 s (an engine that reads Kafka), and the LISTEN connection that
// wakes the workers is in place. It is live unless it was started and a
// worker has exited. An engine that is not started is not ready.
func (e *Engine) Health(ctx context.Context) health.Report {
	if e.ready("Engine.Health") != nil {
		return health.NewReport("engine", true, health.Check{Name: "engine", Detail: "not made by saga.New"})
	}
	h := &e.hstate
	schema := health.Check{Name: "schema", OK: true, Detail: "migrated"}
	if err := pgerr.RetryRead(ctx, func(ctx context.Context) error { return migrations.Check(ctx, e.pool, e.cfg.Schema) }); err != nil {
		schema = health.Check{Name: "schema", Detail: err.Error()}
	}
	running := e.life.Running()
	want, have := e.expectedWorkers(), int(h.workers.Load())
	workers := health.Check{Name: "workers", OK: running && have >= want, Detail: fmt.Sprintf("%d of %d running", have, want)}
	if !running {
		workers.Detail = "the engine is not running"
	}
	h.mu.Lock()
	claim := health.Check{Name: "claim", OK: h.claimErr == nil, Detail: "no claim yet"}
	if h.claimSeen {
		claim.Detail = "last claim succeeded " + time.Since(h.claimAt).Round(time.Millisecond).String() + " ago"
		if h.claimErr != nil {
			claim.Detail = "last claim (or its batch) failed: " + h.claimErr.Error()
		}
	}
	h.mu.Unlock()
	listen := health.Check{Name: "listen", OK: h.listening.Load(), Detail: "connected"}
	if !listen.OK {
		listen.Detail = "not connected: workers poll every PollInterval"
	}
	checks := []health.Check{schema, workers, claim, listen}
	if e.kafkaReaders() > 0 {
		checks = append(checks, h.fetches.Check("kafka"))
	}
	return health.NewReport("engine", running && have < want, checks...)
}
