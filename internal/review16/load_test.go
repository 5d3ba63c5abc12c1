package review16

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/saga"
)

// startMany starts n sagas at once (ids by order id).
func startMany(t *testing.T, r *rig, def *saga.Definition[ord], names []string) map[string]uuid.UUID {
	t.Helper()
	ctx := context.Background()
	ids := map[string]uuid.UUID{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, n := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := saga.Start(ctx, r.engine, def, ord{ID: n}, nil)
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			ids[n] = st.ID
			mu.Unlock()
		}()
	}
	wg.Wait()
	require.Len(t, ids, len(names))
	return ids
}

// exactlyOnce checks that every (saga, effect) of the orchestrator and every
// (saga, kind) of the participant is there at most once, and that no outbox
// dead letter was written.
func (r *rig) exactlyOnce(t *testing.T) {
	t.Helper()
	require.Zero(t, r.orders.Count(t, "SELECT count(*) FROM (SELECT saga_id, what FROM "+r.fx.Table()+
		" GROUP BY 1, 2 HAVING count(*) <> 1) d"), "an effect doubled")
	require.Zero(t, r.part.Count(t, "SELECT count(*) FROM (SELECT saga_id, kind FROM "+r.part.Table("calls")+
		" GROUP BY 1, 2 HAVING count(*) <> 1) d"), "a participant call doubled")
	require.Zero(t, r.deadLetters(t))
}

// Two sagas whose ship is slow (deaf: it ignores ctx for 10 s on its first
// run, then is fast) among 46 healthy ones, all sharing the one reply
// partition, pay's Timeout 8 s, two workers, BatchSize 1 and 16. (The
// review had 84 sagas, 7 s and 5 s: a healthy saga's pay then timed out
// once under -race beside other packages, from load alone.) Doc: "a
// replies' partition is held up by one slow step for the limit at most, and
// by none while the step is handed off". Without the limit the slow runs
// would hold the partition 10 s each, past pay's Timeout. So every saga
// completes (0 lost, 0 stuck within 30 s), each effect and call exactly
// once, no reply_timeout, no abandoned handler (the worker's run is fast).
func TestSlowShipOnSomeSagasAmongManyHealthy(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{1, 16} {
		t.Run(fmt.Sprint(batch), func(t *testing.T) {
			t.Parallel()
			manyWithSlow(t, batch, true)
		})
	}
}

// Control: the same 48 sagas with no slow ship.
func TestManyHealthyControl(t *testing.T) {
	t.Parallel()
	manyWithSlow(t, 16, false)
}

func manyWithSlow(t *testing.T, batch int, slow bool) {
	r := newRig(t, fmt.Sprintf("many%d%v", batch, slow), "", nil)
	r.ship = func(ctx context.Context, run *saga.StepRun, o *ord, n int32) error {
		if slow && strings.HasPrefix(o.ID, "slow") && n == 1 {
			r.sleep(10 * time.Second)
		}
		return r.fx.Record(ctx, run, "ship")
	}
	def := r.def(defOpts{payTimeout: 8 * time.Second})
	r.start(t, func(cfg *saga.Config) {
		cfg.BatchSize = batch
		cfg.HandlerGrace = 10 * time.Second
		if os.Getenv("REVIEW16_NOLIMIT") != "" {
			cfg.Kafka.ReplyStepLimit = -1 // to see the test fail without the limit
		}
	}, def)
	var names []string
	for i := range 48 {
		if i%24 == 7 {
			names = append(names, fmt.Sprint("slow-", i))
		} else {
			names = append(names, fmt.Sprint("h-", i))
		}
	}
	ids := startMany(t, r, def, names)
	for n, id := range ids {
		in := r.ended(t, id)
		require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v %+v", n, timeline(in), in.LastError)
		require.Equal(t, []string{"pick", "paid", "ship", "done"}, r.fx.List(t, id), n)
		require.Equal(t, []string{"pay"}, r.calls(t, id), n)
	}
	r.exactlyOnce(t)
	if slow {
		require.GreaterOrEqual(t, r.engine.Stats().StepsHandedOff, int64(1))
	}
	require.Zero(t, r.engine.Stats().HandlersAbandoned)
}

// Two tenants (two schemas, two engines, own CommandTopic) run the same
// saga with the same step names on one broker; tenant "ta"'s ship is slow
// on its first run (honours ctx, 3 s) for one saga, "tb"'s never. Doc: "for
// a minute after, that step of that saga type goes to a worker straight
// from its reply, on that engine". So ta hands off (≥ 1), tb never does and
// keeps running ship at once after the reply (Chained grows by at least
// two per saga: pay's send after pick, ship after pay's reply); all 16
// complete with their effects once, each participant ran its own tenant's
// pays only.
func TestTwoTenantsOneHandsOff(t *testing.T) {
	t.Parallel()
	kc := kafkatest.New(t)
	rigs := map[string]*rig{}
	defs := map[string]*saga.Definition[ord]{}
	for _, tn := range []string{"ta", "tb"} {
		r := newRig(t, "shop", tn, kc)
		if tn == "ta" {
			r.ship = func(ctx context.Context, run *saga.StepRun, o *ord, n int32) error {
				if o.ID == "ta-0" && n == 1 {
					if !waitCtx(ctx, 3*time.Second) {
						return fmt.Errorf("not cut")
					}
					return ctx.Err()
				}
				return r.fx.Record(ctx, run, "ship")
			}
		}
		defs[tn] = r.def(defOpts{})
		var mod func(*saga.Config)
		if tn == "tb" {
			// tb's quick ship can take more than the 200 ms default on a
			// loaded machine, and would then be handed off on its own
			// account: tb allows a minute, so that only ta's hand-off could
			// stop tb's steps from running at once.
			mod = func(cfg *saga.Config) { cfg.Kafka.ReplyStepLimit = time.Minute }
		}
		r.start(t, mod, defs[tn])
		rigs[tn] = r
	}
	// ta-0 first, alone, so that its ship is tried on the reply worker.
	ctx := context.Background()
	st, err := saga.Start(ctx, rigs["ta"].engine, defs["ta"], ord{ID: "ta-0"}, nil)
	require.NoError(t, err)
	in := rigs["ta"].ended(t, st.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, "%v %+v", timeline(in), in.LastError)
	require.Equal(t, int64(1), rigs["ta"].engine.Stats().StepsHandedOff)
	chainedB := rigs["tb"].engine.Stats().Chained
	all := map[string]map[string]uuid.UUID{}
	for tn, r := range rigs {
		var names []string
		for i := 1; i < 8; i++ {
			names = append(names, fmt.Sprintf("%s-%d", tn, i))
		}
		all[tn] = startMany(t, r, defs[tn], names)
	}
	for tn, r := range rigs {
		for n, id := range all[tn] {
			in := r.ended(t, id)
			require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v %+v", n, timeline(in), in.LastError)
			require.Equal(t, []string{"pick", "paid", "ship", "done"}, r.fx.List(t, id), n)
		}
		r.exactlyOnce(t)
		got := r.part.Count(t, "SELECT count(*) FROM "+r.part.Table("calls")+" WHERE id NOT LIKE $1", tn+"-%")
		require.Zero(t, got, "%s's participant ran another tenant's command", tn)
	}
	require.Zero(t, rigs["tb"].engine.Stats().StepsHandedOff, "tb never hands off")
	require.GreaterOrEqual(t, rigs["tb"].engine.Stats().Chained-chainedB, int64(14), "tb runs ship at once after the reply")
	require.Equal(t, int64(1), rigs["ta"].engine.Stats().StepsHandedOff, "ta's ship goes straight to a worker for a minute")
}
