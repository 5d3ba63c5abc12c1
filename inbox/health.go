package inbox

import (
	"context"

	"github.com/sagaflow/sagaflow/health"
	"github.com/sagaflow/sagaflow/internal/pgerr"
)

// Health reports the consumer's health in the shape every sagaflow part
// uses (see package health): the consumer runs, its database answers, and
// no fetch from its reader failed in the last 30 s (a broker that refuses
// the reader's group session timeout, say, or cannot be reached; the check
// is named "fetch"). It is always live.
func (c *Consumer) Health(ctx context.Context) health.Report {
	running := health.Check{Name: "running", OK: c.life.Running(), Detail: "running"}
	if !running.OK {
		running.Detail = "the consumer is not running"
	}
	db := health.Check{Name: "database", OK: true, Detail: "answers"}
	if err := pgerr.RetryRead(ctx, c.in.pool.Ping); err != nil {
		db = health.Check{Name: "database", Detail: err.Error()}
	}
	return health.NewReport("inbox consumer "+logText(c.in.consumer), false, running, db, c.fetches.Check("fetch"))
}
