package saga_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

var errPermanentDecline = steps.Permanent(errors.New("declined"))

// TestTwoEnginesRunAThousandSagasExactlyOnce runs 1,000 three-step sagas on
// two engines sharing one database; a tenth of them fail at the last step and
// compensate. Every saga must end, and every step's database effect must
// exist exactly once.
func TestTwoEnginesRunAThousandSagasExactlyOnce(t *testing.T) {
	t.Parallel()
	const sagas = 1000
	b := setup(t, nil)
	failing := func(_ context.Context, _ *saga.StepRun, s *order) error {
		if s.OrderID[len(s.OrderID)-1] == '7' { // one in ten
			return errPermanentDecline
		}
		return nil
	}
	// One definition value, registered with both engines, as two processes
	// running the same code would.
	def := threeSteps(b, "load", map[string]saga.StepFunc[order]{"ship/forward": failing})
	require.NoError(t, b.engine.Register(def))
	second, err := saga.New(b.pool, &saga.Config{Schema: b.schema, PollInterval: 100 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	b2 := &bundle{pool: b.pool, schema: b.schema, engine: second}
	require.NoError(t, second.Register(def))

	b.start(t)
	b2.start(t)

	ctx := context.Background()
	ids := make([]uuid.UUID, sagas)
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := w; i < sagas; i += 8 {
				st, err := saga.Start(ctx, b.engine, def, order{OrderID: "o-" + strconv.Itoa(i)}, nil)
				require.NoError(t, err)
				ids[i] = st.ID
				if rand.N(50) == 0 {
					time.Sleep(time.Millisecond)
				}
			}
		})
	}
	wg.Wait()

	waitFor(t, 3*time.Minute, func() bool {
		return b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")+" WHERE status NOT IN ('completed', 'compensated')") == 0
	}, "all sagas to end")

	require.Equal(t, sagas, b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")))
	require.Equal(t, sagas/10, b.count(t, "SELECT count(*) FROM "+b.table("saga_instances")+" WHERE status = 'compensated'"))
	// Exactly one effect per (saga, step, direction): none lost, none doubled.
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM (SELECT 1 FROM "+b.table("effects")+
		" GROUP BY saga_id, step, direction HAVING count(*) <> 1) d"))
	want := 3*sagas - sagas/10 + 2*(sagas/10) // completed: 3; compensated: 2 forward + 2 compensations
	require.Equal(t, want, b.count(t, "SELECT count(*) FROM "+b.table("effects")))
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("outbox")))
	// Both engines did part of the work.
	require.Positive(t, b.engine.Stats().StepsSucceeded)
	require.Positive(t, second.Stats().StepsSucceeded)
	t.Logf("engine 1: %+v", b.engine.Stats())
	t.Logf("engine 2: %+v", second.Stats())
}
