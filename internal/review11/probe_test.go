package review11_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

func TestProbe(t *testing.T) {
	e := newEnv(t)
	bh := newBehave()
	def := fanDef("probe", e.fx, bh, 3, "a", "b")
	e.loseBranch(t, "fan.b", 0)
	g, _ := testkit.StartEngine(t, e.Pool, e.cfg(), def)
	st, err := saga.Start(context.Background(), g, def, order{ID: "1"}, nil)
	require.NoError(t, err)
	waitFor(t, "a done", func() bool { return e.fx.Count(t, st.ID, "fan.a") == 1 })
	t.Log(e.dump(t, st.ID))
	require.NoError(t, e.clk.Advance(context.Background(), 2*slack))
	t.Logf("%+v", rescue(t, g))
	testkit.WaitEnded(t, g, st.ID)
	t.Log(e.dump(t, st.ID))
	t.Log(timeline(t, g, st.ID))
	rows, _ := e.Pool.Query(context.Background(), `SELECT event, coalesce(step_name,''), coalesce(error,''), coalesce(error_code,''), coalesce(detail::text,'') FROM `+e.Table("saga_history")+` WHERE saga_id=$1 ORDER BY id`, st.ID)
	for rows.Next() {
		var a, b, c, d, f string
		rows.Scan(&a, &b, &c, &d, &f)
		t.Log(a, b, c, d, f)
	}
	rows.Close()
}
