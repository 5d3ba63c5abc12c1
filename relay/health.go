package relay

import (
	"context"
	"fmt"

	"github.com/sagaflow/sagaflow/health"
	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/internal/store"
)

// Check reports the relay's health in the shape every sagaflow part uses
// (see package health; [Relay.Health] is the relay's backlog and counters):
// the relay runs, the broker took its last writes, the outbox can be read,
// and the LISTEN connection that wakes it is in place. It is always live: a
// relay that cannot publish only waits.
func (r *Relay) Check(ctx context.Context) health.Report {
	running := health.Check{Name: "running", OK: r.life.Running(), Detail: "running"}
	if !running.OK {
		running.Detail = "the relay is not running"
	}
	outages := r.stats.outageStreak.Load()
	broker := health.Check{Name: "broker", OK: outages == 0, Detail: "the last writes got through"}
	if outages > 0 {
		broker.Detail = fmt.Sprintf("unreachable for the last %d cycles", outages)
	}
	outbox := health.Check{Name: "outbox", OK: true}
	if st, err := r.outboxStatus(ctx); err != nil {
		outbox = health.Check{Name: "outbox", Detail: err.Error()}
	} else {
		outbox.Detail = fmt.Sprintf("%d pending, the oldest %s old; %d dead", st.Pending, st.OldestPendingAge, st.Dead)
	}
	listen := health.Check{Name: "listen", OK: r.listening.Load(), Detail: "connected"}
	if r.cfg.Sweeper {
		listen = health.Check{Name: "listen", OK: true, Detail: "a sweeper does not listen"}
	}
	if !listen.OK {
		listen.Detail = "not connected: the relay polls every PollInterval"
	}
	return health.NewReport("relay", false, running, broker, outbox, listen)
}

// outboxStatus reads the outbox's backlog for Health and Check, again on
// another connection when the one it got was broken (a database restart).
func (r *Relay) outboxStatus(ctx context.Context) (st store.OutboxStatus, err error) {
	err = pgerr.RetryRead(ctx, func(ctx context.Context) error {
		st, err = r.st.RelayOutboxStatus(ctx, r.pool)
		return err
	})
	return st, err
}
