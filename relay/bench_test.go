package relay_test

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/relay"
)

// Topics of the benchmark cluster.
const (
	benchRelayTopic   = "bench-relay"   // 3 partitions: what the relay publishes
	benchRawTopic     = "bench-raw"     // 3 partitions: what the raw writer sends
	benchLatencyTopic = "bench-latency" // 1 partition, read back by one Reader
)

// benchSetup is setup for benchmarks: a fresh schema, migrated, and a
// cluster with the benchmark topics.
func benchSetup(b *testing.B) *env {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	b.Cleanup(cancel)
	pool, schema := pgtest.NewSchema(b)
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(b, err)
	st, err := store.New(schema)
	require.NoError(b, err)
	kc := kafkatest.New(b, kafkatest.SeedTopics(3, benchRelayTopic, benchRawTopic),
		kafkatest.SeedTopics(1, benchLatencyTopic))
	return &env{ctx: ctx, pool: pool, schema: schema, st: st, kc: kc}
}

// benchRow is one outbox row of the throughput benchmark, and the message
// the relay makes of it.
type benchRow struct {
	id      uuid.UUID
	key     string
	payload []byte
}

const benchType = "order.created"

func (r benchRow) message(topic string) kafka.Message {
	return kafka.Message{Topic: topic, Key: []byte(r.key), Value: r.payload, Headers: []kafka.Header{
		{Key: store.HeaderMessageID, Value: []byte(r.id.String())},
		{Key: store.HeaderType, Value: []byte(benchType)},
	}}
}

// BenchmarkRelayThroughput fills the outbox with b.N rows (run it with
// -benchtime=20000x or more), then measures, in the same run and on the
// same in-process cluster:
//
//   - relay_msgs/s: one relay with the default BatchSize draining them,
//     either with RunOnce in a loop (relay=RunOnce: one cycle after the
//     other, claim, write, mark, commit) or as a started relay does
//     (relay=Start: its loop, from Start until it has marked every row
//     published);
//   - raw_msgs/s: a writer from relay.NewKafkaWriter with the same
//     settings sending the same messages (same keys, values and headers)
//     in batches of the same size, one synchronous WriteMessages each;
//   - ratio: relay ÷ raw;
//   - db_msgs/s: the relay's database work alone on the same backlog,
//     written again into the emptied table: its claim and its mark sent as
//     it sends them, one batch after the other, with no message built or
//     written (see relay.DrainMarkingOnly);
//   - db_ratio: db ÷ raw, what the ratio would be if writing cost the relay
//     nothing: on a machine where PostgreSQL, the broker and the benchmark
//     share the cores, the ratio stays below it.
//
// ns/op is the relay's time per message. The backlog is filled with COPY,
// untimed, in one of two shapes:
//
//   - many-tx: as many small transactions leave it: groups of 10 rows, each
//     group 1 ms later (by the database's clock) than the one before;
//   - one-tx: as one large transaction leaves it (a bulk import, a
//     backfill): every row has the same available_at, that transaction's
//     now().
func BenchmarkRelayThroughput(b *testing.B) {
	for _, running := range []bool{false, true} {
		mode := "relay=RunOnce"
		if running {
			mode = "relay=Start"
		}
		b.Run("backlog=many-tx/"+mode, func(b *testing.B) { benchRelayThroughput(b, 10, running) })
		b.Run("backlog=one-tx/"+mode, func(b *testing.B) { benchRelayThroughput(b, b.N, running) })
	}
}

// benchRelayThroughput runs BenchmarkRelayThroughput with a backlog
// written txRows rows per transaction, drained by a started relay when
// running, else by RunOnce in a loop.
func benchRelayThroughput(b *testing.B, txRows int, running bool) {
	e := benchSetup(b)
	n := b.N
	batch := relay.BatchSizeDefault

	rows := make([]benchRow, n)
	for i := range rows {
		rows[i] = benchRow{
			id:  uuid.Must(uuid.NewV7()),
			key: fmt.Sprintf("order-%d", i%1000),
			payload: fmt.Appendf(nil, `{"order_id":"order-%d","seq":%d,"amount_cents":%d,"currency":"EUR",`+
				`"customer":"customer-%d","items":[{"sku":"sku-%d","qty":%d}]}`, i%1000, i, 100+i%9000, i%5000, i%300, 1+i%4),
		}
	}
	// The fill is not measured: COPY, then ANALYZE as autovacuum would.
	// Row i was written by transaction i/txRows; the last one committed at
	// the database's now().
	outbox := pgx.Identifier{e.schema, "outbox"}
	fill := func() {
		var dbNow time.Time
		require.NoError(b, e.pool.QueryRow(e.ctx, "SELECT now()").Scan(&dbNow))
		txs := (n + txRows - 1) / txRows
		copied, err := e.pool.CopyFrom(e.ctx, outbox,
			[]string{"id", "topic", "aggregateid", "type", "payload", "available_at", "created_at"},
			pgx.CopyFromSlice(n, func(i int) ([]any, error) {
				at := dbNow.Add(-time.Duration(txs-1-i/txRows) * time.Millisecond)
				return []any{rows[i].id, benchRelayTopic, rows[i].key, benchType, rows[i].payload, at, at}, nil
			}))
		require.NoError(b, err)
		require.Equal(b, int64(n), copied)
		_, err = e.pool.Exec(e.ctx, "ANALYZE "+outbox.Sanitize())
		require.NoError(b, err)
	}
	fill()

	// Both writers have their metadata and connections before they are timed.
	w := relay.NewKafkaWriter(e.kc.Addrs(), nil)
	defer func() { require.NoError(b, w.Close()) }()
	raw := relay.NewKafkaWriter(e.kc.Addrs(), nil)
	defer func() { require.NoError(b, raw.Close()) }()
	warm := benchRow{id: uuid.Must(uuid.NewV7()), key: "warm-up", payload: []byte("{}")}
	require.NoError(b, w.WriteMessages(e.ctx, warm.message(benchRelayTopic)))
	require.NoError(b, raw.WriteMessages(e.ctx, warm.message(benchRawTopic)))

	// Retention is off so that its first delete does not run during the
	// measurement.
	r, err := relay.New(e.pool, w, &relay.Config{Schema: e.schema, Logger: quiet, BatchSize: batch, Retention: -1})
	require.NoError(b, err)

	runtime.GC()
	b.ResetTimer()
	start := time.Now()
	if running {
		require.NoError(b, r.Start(e.ctx))
		for relay.Published(r) < int64(n) {
			time.Sleep(time.Millisecond)
		}
	} else {
		for published := 0; published < n; {
			p, f, err := r.RunOnce(e.ctx)
			require.NoError(b, err)
			require.Zero(b, f, "rows failed to publish")
			require.Positive(b, p, "a cycle found nothing with %d rows left", n-published)
			published += p
		}
	}
	relayDur := time.Since(start)
	b.StopTimer()
	require.NoError(b, r.Stop(e.ctx))
	require.Equal(b, int64(n), relay.Published(r), "rows published")

	msgs := make([]kafka.Message, n)
	for i, row := range rows {
		msgs[i] = row.message(benchRawTopic)
	}
	runtime.GC()
	start = time.Now()
	for chunk := range slices.Chunk(msgs, batch) {
		require.NoError(b, raw.WriteMessages(e.ctx, chunk...))
	}
	rawDur := time.Since(start)

	// The relay's database work alone, on the same backlog written again
	// into an emptied table: its claims and marks, one batch after the
	// other, with no message built or written (a relay of its own, so that
	// its counts are apart).
	_, err = e.pool.Exec(e.ctx, "TRUNCATE "+outbox.Sanitize())
	require.NoError(b, err)
	fill()
	dbOnly, err := relay.New(e.pool, w, &relay.Config{Schema: e.schema, Logger: quiet, BatchSize: batch, Retention: -1})
	require.NoError(b, err)
	runtime.GC()
	start = time.Now()
	marked, err := relay.DrainMarkingOnly(e.ctx, dbOnly)
	require.NoError(b, err)
	require.Equal(b, n, marked, "rows marked by the database-only drain")
	dbDur := time.Since(start)

	relayRate := float64(n) / relayDur.Seconds()
	rawRate := float64(n) / rawDur.Seconds()
	dbRate := float64(n) / dbDur.Seconds()
	b.ReportMetric(float64(relayDur.Nanoseconds())/float64(n), "ns/op")
	b.ReportMetric(relayRate, "relay_msgs/s")
	b.ReportMetric(rawRate, "raw_msgs/s")
	b.ReportMetric(relayRate/rawRate, "ratio")
	b.ReportMetric(dbRate, "db_msgs/s")
	b.ReportMetric(dbRate/rawRate, "db_ratio")
}

// latencySamplesMax bounds the samples of BenchmarkCommitToKafkaLatency,
// so that it can share the -benchtime of BenchmarkRelayThroughput
// (20000x) and still take seconds, not minutes.
const latencySamplesMax = 2000

// BenchmarkCommitToKafkaLatency measures, with a running relay woken by
// LISTEN/NOTIFY (each transaction inserts one row and notifies the schema's
// channel, as the engine does; PollInterval is the default second), the time
// from a transaction's commit (taken just after tx.Commit returns) to the
// moment a kafka-go Reader on the topic returns its message. One transaction
// at a time, at most one every 5 ms: the relay is idle when each row
// arrives, so this is the latency of the wake-up path, not of a backlog.
// It takes min(b.N, latencySamplesMax) samples and reports p50_ms, p99_ms
// and write_ms (the relay's mean writer call); ns/op is the mean latency.
func BenchmarkCommitToKafkaLatency(b *testing.B) {
	e := benchSetup(b)
	samples := min(b.N, latencySamplesMax)

	w := relay.NewKafkaWriter(e.kc.Addrs(), nil)
	defer func() { require.NoError(b, w.Close()) }()
	r, err := relay.New(e.pool, w, &relay.Config{Schema: e.schema, Logger: quiet})
	require.NoError(b, err)
	require.NoError(b, r.Start(e.ctx))
	defer func() { require.NoError(b, r.Stop(e.ctx)) }()

	reader := kafka.NewReader(kafka.ReaderConfig{
		Brokers:   e.kc.Addrs(),
		Topic:     benchLatencyTopic,
		Partition: 0,
		MinBytes:  1,
		MaxBytes:  1 << 20,
		MaxWait:   time.Second,
	})
	type arrival struct {
		id string
		at time.Time
	}
	arrivals := make(chan arrival, 16)
	readCtx, stopReading := context.WithCancel(e.ctx)
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		for {
			m, err := reader.ReadMessage(readCtx)
			if err != nil {
				return // the benchmark ended, or it notices the silence
			}
			at := time.Now()
			id, _ := header(m, store.HeaderMessageID)
			select {
			case arrivals <- arrival{id: id, at: at}:
			case <-readCtx.Done():
				return
			}
		}
	}()
	defer func() {
		stopReading()
		<-readDone
		require.NoError(b, reader.Close())
	}()

	// send commits one row and returns the time just after the commit.
	send := func(seq int) (uuid.UUID, time.Time) {
		id := uuid.Must(uuid.NewV7())
		tx, err := e.pool.Begin(e.ctx)
		require.NoError(b, err)
		defer func() { _ = tx.Rollback(e.ctx) }()
		require.NoError(b, e.st.InsertMessage(e.ctx, tx, &store.Message{
			ID: id, Topic: benchLatencyTopic, AggregateID: fmt.Sprintf("order-%d", seq%100), Type: benchType,
			Payload: fmt.Appendf(nil, `{"seq":%d}`, seq),
		}))
		require.NoError(b, e.st.Notify(e.ctx, tx, benchLatencyTopic))
		require.NoError(b, tx.Commit(e.ctx))
		return id, time.Now()
	}
	receive := func(id uuid.UUID) time.Time {
		timeout := time.NewTimer(10 * time.Second)
		defer timeout.Stop()
		select {
		case a := <-arrivals:
			require.Equal(b, id.String(), a.id, "messages arrive one at a time, in order")
			return a.at
		case <-timeout.C:
			b.Fatalf("message %s did not reach the reader within 10s", id)
			return time.Time{}
		}
	}

	// One message end to end first: the listener, the writer's metadata
	// and the reader's connection are up before anything is timed.
	id, _ := send(-1)
	receive(id)

	lat := make([]time.Duration, 0, samples)
	pace := time.NewTicker(5 * time.Millisecond)
	defer pace.Stop()
	b.ResetTimer()
	for i := range samples {
		<-pace.C
		id, committed := send(i)
		lat = append(lat, receive(id).Sub(committed))
	}
	b.StopTimer()

	slices.Sort(lat)
	var sum time.Duration
	for _, d := range lat {
		sum += d
	}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	h, err := r.Health(e.ctx)
	require.NoError(b, err)
	b.ReportMetric(float64(sum.Nanoseconds())/float64(len(lat)), "ns/op")
	b.ReportMetric(ms(lat[len(lat)/2]), "p50_ms")
	b.ReportMetric(ms(lat[min(len(lat)-1, len(lat)*99/100)]), "p99_ms")
	b.ReportMetric(ms(h.AvgPublishLatency), "write_ms")
}
