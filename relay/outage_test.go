package relay_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/relay"
)

// brokerDownErrors returns what kafka-go's writer really returns when the
// cluster is down, collected from the in-process cluster: a cluster that
// cuts every connection, partitions that have no leader, too few in-sync
// replicas or time out, and a broker that no longer listens.
func brokerDownErrors(t *testing.T, e *env) []error {
	t.Helper()
	w := e.writer(t)
	msg := kafka.Message{Topic: topicBroken, Value: []byte("probe")}
	var out []error
	collect := func(what string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(e.ctx, 5*time.Second)
		defer cancel()
		err := w.WriteMessages(ctx, msg)
		require.Error(t, err, what)
		t.Logf("%s: %T: %v", what, err, err)
		out = append(out, err)
	}
	require.NoError(t, w.WriteMessages(e.ctx, msg), "the writer knows the cluster")
	for _, code := range []*kerr.Error{kerr.LeaderNotAvailable, kerr.NotEnoughReplicas, kerr.RequestTimedOut} {
		f := e.kc.Kfake().Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topicBroken, Err: code, Count: -1})
		collect(code.Message)
		f.Remove()
	}
	down := e.kc.Unreachable()
	collect("unreachable")
	down.Remove()
	// Nothing listening.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	gone := relay.NewKafkaWriter([]string{addr}, &relay.WriterOpts{MaxAttempts: 1})
	defer func() { require.NoError(t, gone.Close()) }()
	err = gone.WriteMessages(e.ctx, msg)
	require.Error(t, err)
	t.Logf("connection refused: %T: %v", err, err)
	return append(out, err)
}

// outageWriter is a fake writer that, while down, fails every write with one
// of a set of errors in turn: whole-batch errors as they are, and
// kafka.WriteErrors copied onto every message of the batch.
type outageWriter struct {
	mu     sync.Mutex
	errs   []error
	down   bool
	next   int
	writes int
	msgs   []kafka.Message
}

func (w *outageWriter) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return err
	}
	w.writes++
	if !w.down {
		w.msgs = append(w.msgs, msgs...)
		return nil
	}
	err := w.errs[w.next%len(w.errs)]
	w.next++
	var werrs kafka.WriteErrors
	if errors.As(err, &werrs) {
		out := make(kafka.WriteErrors, len(msgs))
		for i := range out {
			out[i] = werrs[0]
		}
		return out
	}
	return err
}

func (w *outageWriter) Close() error { return nil }

func (w *outageWriter) setDown(down bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.down = down
}

// TestThirtyMinuteOutageLosesNothingAndKillsNothing runs the relay, with its
// default configuration, through 30 minutes of a cluster-wide outage without
// waiting them out: between cycles the test moves every row's timestamps
// back by the time the relay asked them to wait, as if that time had passed
// on the database's clock. The writer fails with the errors kafka-go really
// returns when the broker is down. Then the broker comes back.
func TestThirtyMinuteOutageLosesNothingAndKillsNothing(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w := &outageWriter{errs: brokerDownErrors(t, e), down: true}
	r := e.relay(t, w, relay.Config{BatchSize: 20})

	const n = 50
	var ids []uuid.UUID
	for i := range n {
		ids = append(ids, e.insert(t, []string{topicOrders, topicPayments}[i%2], fmt.Sprintf("k%d", i%7), i))
	}

	outbox := pgx.Identifier{e.schema}.Sanitize() + ".outbox"
	const outage = 30 * time.Minute
	var elapsed time.Duration
	var waits []time.Duration // how long the rows were told to wait, step by step
	for elapsed < outage {
		// Every due row is claimed, fails, and is put back.
		for {
			p, f, err := r.RunOnce(e.ctx)
			require.NoError(t, err)
			require.Zero(t, p, "nothing is published while the broker is down")
			if f == 0 {
				break
			}
		}
		var pending, dead, maxAttempts int
		var firstDue, lastDue float64
		require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT count(*) FILTER (WHERE status = 'pending'),
				count(*) FILTER (WHERE status = 'dead'), max(attempts),
				EXTRACT(EPOCH FROM min(available_at) - now())::float8, EXTRACT(EPOCH FROM max(available_at) - now())::float8
			FROM `+outbox).Scan(&pending, &dead, &maxAttempts, &firstDue, &lastDue))
		require.Equal(t, n, pending, "after %v of outage", elapsed)
		require.Zero(t, dead, "after %v of outage", elapsed)
		require.Zero(t, maxAttempts, "an outage spends no attempt (after %v)", elapsed)
		require.Positive(t, firstDue, "every row waits after its failure")
		step := time.Duration(lastDue * float64(time.Second))
		require.LessOrEqual(t, step, relay.OutageBackoffMaxDefault, "the wait is capped")
		waits = append(waits, step)
		// Let the longest wait pass (and a millisecond, so that no row is
		// due a moment after the next claim's now()).
		_, err := e.pool.Exec(e.ctx, `UPDATE `+outbox+` SET available_at = available_at - $1::float8 * interval '1 second',
			created_at = created_at - $1::float8 * interval '1 second'`, lastDue+0.001)
		require.NoError(t, err)
		elapsed += step
	}
	t.Logf("%d outage cycles over %v; waits from %v to %v", len(waits), elapsed, waits[0], waits[len(waits)-1])
	require.Greater(t, len(waits), relay.MaxAttemptsDefault, "more failed cycles than MaxAttempts allows attempts")
	require.LessOrEqual(t, waits[0], 5*time.Second, "the first waits are short (three batches: 1s, 2s, 4s, with jitter)")
	require.Greater(t, waits[len(waits)-1], 20*time.Second, "the wait grows to near the cap")

	h, err := r.Health(e.ctx)
	require.NoError(t, err)
	require.Equal(t, int64(n), h.Pending)
	require.Zero(t, h.Dead)
	require.GreaterOrEqual(t, h.OldestPendingAge, outage, "the backlog is 30 minutes old")
	require.Zero(t, h.Retries, "no attempt was spent")
	require.Equal(t, int64(n*len(waits)), h.OutageWaits)
	require.Equal(t, int64(3*len(waits)), h.ConsecutiveOutages, "three batches a cycle")

	// The broker is back.
	w.setDown(false)
	_, err = e.pool.Exec(e.ctx, `UPDATE `+outbox+` SET available_at = now()`)
	require.NoError(t, err)
	published, failed := drain(t, e.ctx, r)
	require.Equal(t, n, published)
	require.Zero(t, failed)
	got := copies(t, w.msgs)
	require.Len(t, got, n, "every row published")
	for _, id := range ids {
		require.Equal(t, 1, got[id.String()], "row %s published once", id)
		row := e.row(t, id)
		require.Equal(t, store.OutboxPublished, row.Status)
		require.Equal(t, 1, row.Attempts, "only the attempt that published counts")
	}
	h, err = r.Health(e.ctx)
	require.NoError(t, err)
	require.Zero(t, h.Pending)
	require.Zero(t, h.Dead)
	require.Zero(t, h.ConsecutiveOutages)
}

// TestOutageConformance takes the real cluster away while a running relay
// with MaxAttempts 2 publishes: rows fail many more times than that while
// it is away, stay pending, and are published once it is back.
func TestOutageConformance(t *testing.T) {
	t.Parallel()
	cfg := relay.Config{
		MaxAttempts:      2,
		Backoff:          func(int) time.Duration { return 20 * time.Millisecond },
		OutageBackoffMax: 50 * time.Millisecond,
		PollInterval:     50 * time.Millisecond,
	}
	const n = 12
	check := func(t *testing.T, e *env, r *relay.Relay, ids []uuid.UUID) {
		t.Helper()
		// Each row failed at least three times: twice as many as MaxAttempts.
		waitFor(t, 15*time.Second, "rows failing through the outage", func() bool {
			h, err := r.Health(e.ctx)
			require.NoError(t, err)
			return h.OutageWaits >= 3*n
		})
		h, err := r.Health(e.ctx)
		require.NoError(t, err)
		require.Positive(t, h.ConsecutiveOutages)
		require.Zero(t, h.Dead)
		for _, id := range ids {
			got := e.row(t, id)
			require.Equal(t, store.OutboxPending, got.Status)
			require.Zero(t, got.Attempts)
			require.NotEmpty(t, got.LastError)
		}
	}
	published := func(t *testing.T, e *env) {
		t.Helper()
		waitFor(t, 20*time.Second, "every row published", func() bool {
			return e.count(t, store.OutboxPublished) == n
		})
		require.Zero(t, e.count(t, store.OutboxDead))
	}

	t.Run("unreachable", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		r := e.relay(t, e.writer(t), cfg)
		down := e.kc.Unreachable()
		defer down.Remove()
		var ids []uuid.UUID
		for i := range n {
			ids = append(ids, e.insert(t, []string{topicOrders, topicPayments}[i%2], fmt.Sprintf("k%d", i), i))
		}
		require.NoError(t, r.Start(e.ctx))
		check(t, e, r, ids)
		down.Remove()
		published(t, e)
		got := copies(t, e.read(t, topicOrders, topicPayments))
		require.Len(t, got, n)
		for _, id := range ids {
			require.Equal(t, 1, got[id.String()], "failed produce requests store nothing")
		}
	})

	t.Run("stopped and started", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		// A cluster of our own on a fixed port, so that one started later
		// is found at the same address.
		start := func(port int) *kfake.Cluster {
			c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.Ports(port), kfake.SeedTopics(1, topicOrders))
			require.NoError(t, err)
			return c
		}
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		port := l.Addr().(*net.TCPAddr).Port
		require.NoError(t, l.Close())
		first := start(port)
		addrs := first.ListenAddrs()
		w := relay.NewKafkaWriter(addrs, &relay.WriterOpts{MaxAttempts: 1, MetadataTTL: 200 * time.Millisecond})
		defer func() { require.NoError(t, w.Close()) }()
		r := e.relay(t, w, cfg)
		e.insert(t, topicOrders, "warm-up", -1)
		p, _, err := r.RunOnce(e.ctx)
		require.NoError(t, err)
		require.Equal(t, 1, p, "the writer knows the cluster")
		first.Close() // the broker is gone: connections are refused

		var ids []uuid.UUID
		for i := range n {
			ids = append(ids, e.insert(t, topicOrders, fmt.Sprintf("k%d", i), i))
		}
		require.NoError(t, r.Start(e.ctx))
		check(t, e, r, append(ids[:0:0], ids...))

		second := start(port)
		defer second.Close()
		waitFor(t, 20*time.Second, "every row published", func() bool {
			return e.count(t, store.OutboxPublished) == n+1
		})
		require.Zero(t, e.count(t, store.OutboxDead))
		require.NoError(t, r.Stop(e.ctx))
		got := copies(t, readPartition0(t, e.ctx, addrs[0], topicOrders, n))
		for _, id := range ids {
			require.GreaterOrEqual(t, got[id.String()], 1, "row %s reached the restarted broker", id)
		}
	})
}

// readPartition0 reads the first want messages of partition 0 of topic.
func readPartition0(t *testing.T, ctx context.Context, addr, topic string, want int) []kafka.Message {
	t.Helper()
	rd := kafka.NewReader(kafka.ReaderConfig{Brokers: []string{addr}, Topic: topic, Partition: 0, MaxWait: 100 * time.Millisecond})
	defer func() { require.NoError(t, rd.Close()) }()
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	var out []kafka.Message
	for len(out) < want {
		m, err := rd.ReadMessage(ctx)
		require.NoError(t, err)
		out = append(out, m)
	}
	return out
}
