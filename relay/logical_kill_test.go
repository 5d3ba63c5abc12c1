package relay_test

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/relay"
)

// TestLogicalRelayProcess is the relay process that
// TestLogicalRelaySIGKILL kills; it does nothing in a normal run.
func TestLogicalRelayProcess(t *testing.T) {
	conn, brokers := os.Getenv("SAGAFLOW_CDC_CHILD_PG"), os.Getenv("SAGAFLOW_CDC_CHILD_KAFKA")
	if conn == "" {
		t.Skip("run by TestLogicalRelaySIGKILL as its relay process")
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, conn)
	require.NoError(t, err)
	w := relay.NewKafkaWriter(strings.Split(brokers, ","), &relay.WriterOpts{MaxAttempts: 1})
	lr, err := relay.NewLogical(pool, conn, w, &relay.LogicalConfig{
		Schema: cdcSchema, Slot: "cdc_test", Publication: "cdc_test", Logger: quiet})
	require.NoError(t, err)
	for { // until killed
		_ = lr.Run(ctx)
		time.Sleep(100 * time.Millisecond)
	}
}

// TestLogicalRelaySIGKILL kills the relay's process with SIGKILL while it
// streams, starts another, and counts every message by id.
func TestLogicalRelaySIGKILL(t *testing.T) {
	e := setupLogical(t)
	spawn := func() *exec.Cmd {
		cmd := exec.Command(os.Args[0], "-test.run=^TestLogicalRelayProcess$", "-test.count=1")
		cmd.Env = append(os.Environ(), "SAGAFLOW_CDC_CHILD_PG="+e.srv.ConnString(),
			"SAGAFLOW_CDC_CHILD_KAFKA="+strings.Join(e.kc.Addrs(), ","))
		require.NoError(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		return cmd
	}
	child := spawn()
	var want []string
	seq := 0
	batch := func(n int) {
		seqs := make([]int, n)
		for i := range seqs {
			seq++
			seqs[i] = seq
		}
		for _, id := range e.insert(t, seqs, "relay") {
			want = append(want, id.String())
		}
	}
	for range 20 {
		batch(5)
	}
	// Kill while it streams: once some but (usually) not all are published.
	waitFor(t, time.Minute, "the child to publish", func() bool { return e.published(t) > 0 })
	require.NoError(t, child.Process.Signal(syscall.SIGKILL))
	_ = child.Wait()
	killedAt := e.published(t)
	for range 20 {
		batch(5)
	}
	spawn()
	waitFor(t, time.Minute, "every row published", func() bool { return e.published(t) == len(want) })

	msgs, err := e.kc.ReadAll(e.ctx, topicOrders)
	require.NoError(t, err)
	n := copies(t, msgs)
	lost := 0
	for _, id := range want {
		if n[id] == 0 {
			lost++
		}
	}
	require.Zero(t, lost, "messages lost")
	require.Len(t, n, len(want))
	t.Logf("killed with %d of 100 rows marked published; %d rows, %d messages, 0 lost", killedAt, len(want), len(msgs))
}
