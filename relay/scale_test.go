package relay_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/relay"
)

// TestThreeRelaysPublishTenThousandRowsCommittedOutOfOrder: three relays run
// while many transactions write 10,000 rows, some of them held open long
// enough that their rows commit after rows written later were published. A
// relay that paged the outbox by id or created_at would step past them;
// every row must reach the broker, exactly once without crashes, and end
// 'published'.
func TestThreeRelaysPublishTenThousandRowsCommittedOutOfOrder(t *testing.T) {
	t.Parallel()
	e := setup(t)

	const (
		total   = 10_000
		writers = 20
		relays  = 3
	)

	// The writers get a pool of their own, as an application would: their
	// held transactions must not starve the relays of connections.
	cfg, err := pgxpool.ParseConfig(pgtest.ConnString(t))
	require.NoError(t, err)
	cfg.MaxConns = writers
	wpool, err := pgxpool.NewWithConfig(e.ctx, cfg)
	require.NoError(t, err)
	defer wpool.Close()

	rs := make([]*relay.Relay, relays)
	for i := range rs {
		rs[i] = e.relay(t, e.writer(t), relay.Config{BatchSize: 100, PollInterval: 200 * time.Millisecond})
		require.NoError(t, rs[i].Start(e.ctx))
	}

	// Split the rows into transactions of 1–50 rows; about one in eight
	// is held open 300–800 ms before it commits.
	type txPlan struct {
		rows int
		hold time.Duration
	}
	var plans []txPlan
	for left := total; left > 0; {
		p := txPlan{rows: min(1+rand.IntN(50), left)}
		if rand.IntN(8) == 0 {
			p.hold = 300*time.Millisecond + rand.N(500*time.Millisecond)
		}
		plans = append(plans, p)
		left -= p.rows
	}
	work := make(chan txPlan, len(plans))
	for _, p := range plans {
		work <- p
	}
	close(work)

	var (
		mu    sync.Mutex
		ids   = make(map[uuid.UUID]struct{}, total)
		held  []uuid.UUID // rows of held transactions
		wg    sync.WaitGroup
		errMu sync.Mutex
		errs  []error
	)
	seq := make(chan int, total)
	for i := range total {
		seq <- i
	}
	close(seq)
	writeTx := func(ctx context.Context, p txPlan) error {
		tx, err := wpool.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
		mine := make([]uuid.UUID, 0, p.rows)
		for range p.rows {
			i := <-seq
			m := &store.Message{
				ID:          uuid.Must(uuid.NewV7()),
				Topic:       []string{topicOrders, topicPayments}[i%2],
				AggregateID: fmt.Sprintf("agg-%d", i%97),
				Type:        "scale.event",
				Payload:     fmt.Appendf(nil, `{"seq":%d}`, i),
			}
			if err := e.st.InsertMessage(ctx, tx, m); err != nil {
				return err
			}
			mine = append(mine, m.ID)
		}
		if err := e.st.Notify(ctx, tx, topicOrders); err != nil {
			return err
		}
		if p.hold > 0 {
			// Holding the transaction open is the point of the test, not a
			// wait for something to happen.
			timer := time.NewTimer(p.hold)
			select {
			case <-ctx.Done():
				timer.Stop()
				return ctx.Err()
			case <-timer.C:
			}
		}
		if err := tx.Commit(ctx); err != nil {
			return err
		}
		mu.Lock()
		for _, id := range mine {
			ids[id] = struct{}{}
		}
		if p.hold > 0 {
			held = append(held, mine...)
		}
		mu.Unlock()
		return nil
	}
	start := time.Now()
	for range writers {
		wg.Go(func() {
			for p := range work {
				if err := writeTx(e.ctx, p); err != nil {
					errMu.Lock()
					errs = append(errs, err)
					errMu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	require.Empty(t, errs)
	require.Len(t, ids, total)
	written := time.Since(start)

	waitFor(t, 30*time.Second, "every row published", func() bool {
		return e.count(t, store.OutboxPublished) == total
	})
	elapsed := time.Since(start)
	require.Zero(t, e.count(t, store.OutboxPending))
	require.Zero(t, e.count(t, store.OutboxDead))
	perRelay := make([]int64, relays)
	var sum int64
	for i, r := range rs {
		require.NoError(t, r.Stop(e.ctx))
		h, err := r.Health(e.ctx)
		require.NoError(t, err)
		require.Zero(t, h.Retries)
		perRelay[i] = h.Published
		sum += h.Published
	}
	require.Equal(t, int64(total), sum, "the relays' published counts add up to the rows")

	// The test did what it means to: rows of held transactions were
	// published after rows written later than them.
	var overtaken int
	require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT count(*) FROM `+pgx.Identifier{e.schema, "outbox"}.Sanitize()+` h
		WHERE h.id = ANY($1) AND EXISTS (SELECT 1 FROM `+pgx.Identifier{e.schema, "outbox"}.Sanitize()+` p
			WHERE p.created_at > h.created_at AND p.published_at < h.published_at)`, held).Scan(&overtaken))
	require.Positive(t, overtaken, "no held row was overtaken by a later one: the test did not exercise late commits")

	msgs := e.read(t, topicOrders, topicPayments)
	got := copies(t, msgs)
	var missing, duplicates int
	for id := range ids {
		switch n := got[id.String()]; {
		case n == 0:
			missing++
		case n > 1:
			duplicates += n - 1
		}
	}
	t.Logf("%d rows in %d transactions (%d rows held open) written in %v, all published after %v by %d relays (%v); "+
		"%d held rows published after later rows; %d messages read, %d missing, %d duplicates",
		total, len(plans), len(held), written.Round(time.Millisecond), elapsed.Round(time.Millisecond), relays, perRelay,
		overtaken, len(msgs), missing, duplicates)
	require.Zero(t, missing, "rows never published")
	require.Len(t, got, total, "messages that name no row written by the test")
	require.Zero(t, duplicates, "without crashes every row is published once")
	require.Len(t, msgs, total)
}
