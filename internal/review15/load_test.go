package review15

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/saga"
)

// Two tenants (two schemas, two engines with their own CommandTopic) run
// the same saga "shop" (same step and command type names) on one broker,
// eight sagas each, started at once: every saga completes, each
// participant ran only its own tenant's pays and bills, once each, and
// neither engine dead-lettered anything.
func TestTwoTenantsSameSagaOneBroker(t *testing.T) {
	t.Parallel()
	kc := kafkatest.New(t)
	tenants := map[string]*rig{}
	defs := map[string]*saga.Definition[ord]{}
	for _, tn := range []string{"ta", "tb"} {
		r := newTenantRig(t, "shop", tn, kc)
		defs[tn] = r.def(1)
		r.start(t, nil, defs[tn])
		tenants[tn] = r
	}
	ctx := context.Background()
	ids := map[string][]uuid.UUID{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for tn, r := range tenants {
		for i := 0; i < 8; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				st, err := saga.Start(ctx, r.engine, defs[tn], ord{ID: fmt.Sprintf("%s-%d", tn, i)}, nil)
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				ids[tn] = append(ids[tn], st.ID)
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	for tn, r := range tenants {
		for _, id := range ids[tn] {
			in := r.ended(t, id)
			require.Equal(t, saga.StatusCompleted, in.Status, "%s %v %+v", tn, timeline(in), in.LastError)
			require.Equal(t, []string{"pay", "bill"}, r.calls(t, id), tn)
			require.Equal(t, []string{"pick", "paid", "ship"}, r.fx.List(t, id), tn)
		}
		rows, err := r.part.Pool.Query(ctx, "SELECT id FROM "+r.part.Table("calls"))
		require.NoError(t, err)
		got, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		require.Len(t, got, 16, "%s's participant ran its own 8 pays and 8 bills: %v", tn, got)
		for _, g := range got {
			require.True(t, strings.HasPrefix(g, tn+"-"), "%s's participant ran %s", tn, g)
		}
		require.Zero(t, r.orders.Count(t, "SELECT count(*) FROM "+r.orders.Table("dead_letters")), "%s dead-lettered something", tn)
	}
}

// 100 sagas started at once, on engines with one and with two workers:
// every saga completes, each effect (pick, paid, ship; pay, bill at the
// participant) exactly once, and no outbox row is left pending on either
// side once the relays caught up.
func TestManySagasFewWorkers(t *testing.T) {
	t.Parallel()
	for _, workers := range []int{1, 2} {
		t.Run(fmt.Sprint(workers), func(t *testing.T) {
			t.Parallel()
			r := newRig(t, fmt.Sprintf("many%d", workers), nil)
			def := r.def(1)
			r.start(t, func(cfg *saga.Config) { cfg.Workers = workers }, def)
			ctx := context.Background()
			const n = 100
			ids := make([]uuid.UUID, n)
			var wg sync.WaitGroup
			for i := range n {
				wg.Add(1)
				go func() {
					defer wg.Done()
					st, err := saga.Start(ctx, r.engine, def, ord{ID: fmt.Sprint(i)}, nil)
					if err != nil {
						t.Error(err)
						return
					}
					ids[i] = st.ID
				}()
			}
			wg.Wait()
			for _, id := range ids {
				in := r.ended(t, id)
				require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", timeline(in), in.LastError)
			}
			require.Equal(t, 3*n, r.orders.Count(t, "SELECT count(*) FROM "+r.fx.Table()))
			require.Zero(t, r.orders.Count(t, "SELECT count(*) FROM (SELECT saga_id, what FROM "+r.fx.Table()+
				" GROUP BY 1, 2 HAVING count(*) <> 1) d"), "each effect once")
			require.Zero(t, r.part.Count(t, "SELECT count(*) FROM (SELECT saga_id, kind FROM "+r.part.Table("calls")+
				" GROUP BY 1, 2 HAVING count(*) <> 1) d"), "each call once")
			require.Equal(t, 2*n, r.part.Count(t, "SELECT count(*) FROM "+r.part.Table("calls")))
			require.Zero(t, r.orders.Count(t, "SELECT count(*) FROM "+r.orders.Table("dead_letters")))
			waitNoPending(t, r.orders)
			waitNoPending(t, r.part)
			require.GreaterOrEqual(t, r.engine.Stats().Chained, int64(n), "bill chained after pay's reply")
		})
	}
}
