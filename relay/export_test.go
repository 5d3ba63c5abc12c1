package relay

import (
	"context"

	"github.com/sagaflow/sagaflow/internal/store"
)

// SetAfterPublish installs a hook that runs after the writer returned and
// before the batch's rows are marked; an error from it aborts the cycle as a
// crash between the broker's acknowledgement and the commit would. Set it
// before the relay runs.
func SetAfterPublish(r *Relay, f func() error) { r.hooks.afterPublish = f }

// Published returns how many rows r has marked published, without the
// database query of Health.
func Published(r *Relay) int64 { return r.stats.published.Load() }

// SetAfterClaim installs a hook that runs after each claim, with the number
// of rows claimed. Set it before the relay runs.
func SetAfterClaim(r *Relay, f func(rows int)) { r.hooks.afterClaim = f }

// Listening reports whether r's LISTEN connection is in place.
func Listening(r *Relay) bool { return r.listening.Load() }

// DrainMarkingOnly drains r's backlog with r's own database work and nothing
// else: batch after batch, each claimed as a drain claims it (after the last
// row claimed, but every fullClaimEvery-th from the oldest due row) and its
// rows marked published and committed as settle marks them, with no message
// built or written. It returns how many rows it marked.
func DrainMarkingOnly(ctx context.Context, r *Relay) (int, error) {
	var after *store.RelayPosition
	marked := 0
	for claims := 1; ; claims++ {
		b, err := r.claim(ctx, after)
		if err != nil {
			return marked, err
		}
		if len(b.rows) == 0 {
			b.release(ctx)
			return marked, nil
		}
		for i := range b.rows {
			b.published = append(b.published, b.rows[i].ID)
		}
		if err := r.settle(ctx, b, nil); err != nil {
			return marked, err
		}
		marked += len(b.rows)
		after = b.rows[len(b.rows)-1].Position()
		if r.cfg.Sweeper || claims%fullClaimEvery == 0 {
			after = nil
		}
	}
}
