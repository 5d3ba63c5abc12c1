package relay_test

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
)

// ackWriter passes writes on and reports, for each acknowledged message,
// the time since the commit its payload records.
type ackWriter struct {
	relay.Writer
	acked chan time.Duration
}

func (w *ackWriter) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	err := w.Writer.WriteMessages(ctx, msgs...)
	if err != nil {
		return err
	}
	now := time.Now()
	for _, m := range msgs {
		if ns, perr := strconv.ParseInt(string(m.Value), 10, 64); perr == nil {
			w.acked <- now.Sub(time.Unix(0, ns))
		}
	}
	return nil
}

// logicalBench starts what a log-based relay's benchmark needs: a throwaway
// server with wal_level=logical, a pool on it and a kfake cluster with
// topicOrders. It skips the benchmark where no such server can start.
func logicalBench(b *testing.B) (context.Context, *pgtest.Server, *pgxpool.Pool, *kafkatest.Cluster) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	b.Cleanup(cancel)
	srv, err := pgtest.StartLogicalServer(ctx)
	if err != nil {
		b.Skipf("no throwaway PostgreSQL with wal_level=logical: %v", err)
	}
	b.Cleanup(func() { _ = srv.Stop(context.Background()) })
	pool, err := pgxpool.New(ctx, srv.ConnString())
	require.NoError(b, err)
	b.Cleanup(pool.Close)
	return ctx, srv, pool, kafkatest.New(b, kafkatest.SeedTopics(3, topicOrders))
}

// BenchmarkCommitToPublish measures, in one run on one server, the time
// from an outbox row's commit to the broker's acknowledgement of its
// message, for the polling relay (woken by NOTIFY) and the log-based relay.
// Rows are written one per transaction, one at a time, so the numbers are
// latency without a queue. Reported as p50 and p99 in microseconds.
func BenchmarkCommitToPublish(b *testing.B) {
	ctx, srv, pool, kc := logicalBench(b)

	run := func(b *testing.B, schema string, start func(w relay.Writer) func()) {
		_, err := migrations.Migrate(ctx, pool, schema)
		require.NoError(b, err)
		ob, err := outbox.New(pool, schema)
		require.NoError(b, err)
		kw := relay.NewKafkaWriter(kc.Addrs(), nil)
		defer kw.Close()
		w := &ackWriter{Writer: kw, acked: make(chan time.Duration, 16)}
		stop := start(w)
		defer stop()
		var lat []time.Duration
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			tx, err := pool.Begin(ctx)
			require.NoError(b, err)
			require.NoError(b, ob.InsertTx(ctx, tx, outbox.Message{Topic: topicOrders, Key: "k", Type: "bench",
				Payload: []byte(strconv.FormatInt(time.Now().UnixNano(), 10))}))
			require.NoError(b, tx.Commit(ctx))
			select {
			case d := <-w.acked:
				lat = append(lat, d)
			case <-ctx.Done():
				b.Fatal("timed out waiting for a publish")
			}
		}
		b.StopTimer()
		slices.Sort(lat)
		b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
		b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
	}

	b.Run("polling", func(b *testing.B) {
		run(b, "bench_poll_"+strconv.Itoa(b.N), func(w relay.Writer) func() {
			r, err := relay.New(pool, w, &relay.Config{Schema: "bench_poll_" + strconv.Itoa(b.N), Logger: quiet})
			require.NoError(b, err)
			require.NoError(b, r.Start(ctx))
			return func() { _ = r.Stop(context.Background()) }
		})
	})
	b.Run("logical", func(b *testing.B) {
		schema := "bench_log_" + strconv.Itoa(b.N)
		run(b, schema, func(w relay.Writer) func() {
			lr, err := relay.NewLogical(pool, srv.ConnString(), w, &relay.LogicalConfig{
				Schema: schema, Slot: schema, Publication: schema, Logger: quiet})
			require.NoError(b, err)
			require.NoError(b, lr.Setup(ctx))
			rctx, cancel := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() { defer close(done); _ = lr.Run(rctx) }()
			return func() {
				cancel()
				<-done
				_, _ = pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, schema)
			}
		})
	})
}

// BenchmarkLogicalDrain measures the log-based relay's rate on a backlog of
// b.N rows written one per transaction before it starts: each transaction
// is published and then marked, so the marks' cost per transaction shows.
// Reported as msgs/s.
func BenchmarkLogicalDrain(b *testing.B) {
	ctx, srv, pool, kc := logicalBench(b)
	schema := "bench_drain_" + strconv.Itoa(b.N)
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(b, err)
	ob, err := outbox.New(pool, schema)
	require.NoError(b, err)
	kw := relay.NewKafkaWriter(kc.Addrs(), nil)
	defer kw.Close()
	lr, err := relay.NewLogical(pool, srv.ConnString(), kw, &relay.LogicalConfig{
		Schema: schema, Slot: schema, Publication: schema, Logger: quiet})
	require.NoError(b, err)
	require.NoError(b, lr.Setup(ctx))
	defer func() { _, _ = pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, schema) }()
	for i := 0; i < b.N; i++ {
		tx, err := pool.Begin(ctx)
		require.NoError(b, err)
		require.NoError(b, ob.InsertTx(ctx, tx, outbox.Message{Topic: topicOrders, Key: "k" + strconv.Itoa(i%64), Type: "bench",
			Payload: []byte(strconv.Itoa(i))}))
		require.NoError(b, tx.Commit(ctx))
	}
	b.ResetTimer()
	start := time.Now()
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = lr.Run(rctx) }()
	for {
		var pending int
		require.NoError(b, pool.QueryRow(ctx, `SELECT count(*) FROM `+schema+`.outbox WHERE status = 'pending'`).Scan(&pending))
		if pending == 0 {
			break
		}
		if ctx.Err() != nil {
			b.Fatalf("%d rows still pending", pending)
		}
		time.Sleep(5 * time.Millisecond)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	stop()
	<-done
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
}
