package review13

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

// Two tenants (two schemas, two engines, each with its own CommandTopic as
// KafkaConfig.GroupID asks) run the same saga type "shop" on one broker,
// every pay sent chained in pick's update: each tenant's sagas complete,
// each participant ran exactly its own tenant's pays once each, and
// neither engine dead-lettered anything (no reply crossed over).
func TestTwoTenantsSameSagaOneBroker(t *testing.T) {
	t.Parallel()
	kc := kafkatest.New(t)
	tenants := map[string]*rig{}
	defs := map[string]*saga.Definition[ord]{}
	for _, tn := range []string{"ta", "tb"} {
		r := newTenantRig(t, "shop", tn, kc)
		def := saga.Define("shop",
			saga.Step[ord]{Name: "pick", Action: func(ctx context.Context, run *saga.StepRun, _ *ord) error {
				return r.fx.Record(ctx, run, "pick")
			}},
			saga.Step[ord]{Name: "pay", Timeout: wait, Remote: r.remote(
				func(ctx context.Context, run *saga.StepRun, o *ord) (any, error) {
					if strings.HasSuffix(o.ID, "-tx") {
						if _, err := run.Tx.Exec(ctx, "SELECT 1"); err != nil {
							return nil, err
						}
					}
					return payCmd{ID: o.ID}, nil
				})},
		)
		r.start(t, nil, def)
		tenants[tn] = r
		defs[tn] = def
	}
	// The rig named the pay type after the saga: both tenants send "shop.pay".
	ctx := context.Background()
	ids := map[string][]uuid.UUID{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for tn, r := range tenants {
		for i := 0; i < 6; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				suffix := ""
				if i%2 == 1 {
					suffix = "-tx"
				}
				st, err := saga.Start(ctx, r.engine, defs[tn], ord{ID: fmt.Sprintf("%s-%d%s", tn, i, suffix)}, nil)
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
			require.Equal(t, saga.StatusCompleted, in.Status, "%s %v %+v", tn, types(in), in.LastError)
			require.Equal(t, []string{"pay"}, r.calls(t, id), tn)
		}
		rows, err := r.part.Pool.Query(ctx, "SELECT id FROM "+r.part.Table("calls"))
		require.NoError(t, err)
		got, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		require.Len(t, got, 6, "%s's participant ran its own six pays only: %v", tn, got)
		for _, g := range got {
			require.True(t, strings.HasPrefix(g, tn+"-"), "%s's participant ran %s", tn, g)
		}
		require.Zero(t, r.orders.Count(t, "SELECT count(*) FROM "+r.orders.Table("dead_letters")), "%s dead-lettered something", tn)
	}
}
