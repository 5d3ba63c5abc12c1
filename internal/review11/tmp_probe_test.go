package review11_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

func TestProbeWake(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	def := saga.Define("waiter", saga.Step[order]{Name: "await", Wait: saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, _ *order, _ json.RawMessage) error { return nil })})
	g, stop := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	st, _ := saga.Start(ctx, g, def, order{}, nil)
	waitFor(t, "w", func() bool { in, _ := g.Get(ctx, st.ID); return in.Wait != nil })
	stop()
	g.Signal(ctx, saga.Signal{SagaID: st.ID, Name: "go", Payload: json.RawMessage(`{}`)})
	rows, _ := e.Pool.Query(ctx, `SELECT type, coalesce(step_key,'<null>'), topic, delivery, aggregatetype FROM `+e.Table("outbox"))
	for rows.Next() {
		var a, b, c, d, f string
		rows.Scan(&a, &b, &c, &d, &f)
		t.Log(a, b, c, d, f)
	}
}
