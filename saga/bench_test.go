package saga_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
)

// BenchmarkStepThroughput measures, in one run and at the same concurrency,
// a 3-step saga with trivial handlers against a raw baseline: a pgx loop
// doing the SQL of one step (update a row, insert two) in one transaction,
// statement by statement. b.N counts steps. Run it with a fixed count, e.g.
// -benchtime=6000x; make bench does.
//
// Reported: engine_steps/s, raw_steps/s, ratio (engine/raw), and the
// engine's step-to-step latency p50_ms and p99_ms in database time.
func BenchmarkStepThroughput(b *testing.B) {
	for _, conc := range []int{1, 4, 8, 16} {
		b.Run(fmt.Sprintf("conc=%d", conc), func(b *testing.B) {
			steps := max(b.N, 300)
			pool, schema := pgtest.NewSchema(b)
			pool.Config().MaxConns = int32(conc + 4)
			ctx := context.Background()
			_, err := migrations.Migrate(ctx, pool, schema)
			require.NoError(b, err)

			// The pool of NewSchema is small; give both sides room.
			big := biggerPool(b, pool, conc+4)

			rawRate := rawBaseline(b, big, schema, conc, steps)
			engRate, p50, p99 := engineRun(b, big, schema, conc, steps, saturatingLoad)
			b.ReportMetric(rawRate, "raw_steps/s")
			b.ReportMetric(engRate, "engine_steps/s")
			b.ReportMetric(engRate/rawRate, "ratio")
			b.ReportMetric(float64(p50.Microseconds())/1000, "p50_ms")
			b.ReportMetric(float64(p99.Microseconds())/1000, "p99_ms")
		})
	}
}

// BenchmarkStepLatency measures step-to-step latency under light load: 4
// sagas in flight on 4 workers, so the figures are the engine's own delay
// (commit, notification, claim) rather than queueing.
func BenchmarkStepLatency(b *testing.B) {
	steps := max(b.N, 300)
	pool, schema := pgtest.NewSchema(b)
	_, err := migrations.Migrate(context.Background(), pool, schema)
	require.NoError(b, err)
	rate, p50, p99 := engineRun(b, biggerPool(b, pool, 8), schema, 4, steps, 4)
	b.ReportMetric(rate, "engine_steps/s")
	b.ReportMetric(float64(p50.Microseconds())/1000, "p50_ms")
	b.ReportMetric(float64(p99.Microseconds())/1000, "p99_ms")
}

// BenchmarkStepThroughputFilled runs the engine side of
// BenchmarkStepThroughput (conc 8) on an empty schema and on one that holds
// SAGAFLOW_BENCH_FILL finished sagas (default 1,000,000) with their history
// (five entries each) and inbox keys (three each), as a month of retention
// would leave them. Reported: engine_steps/s for both and their ratio.
func BenchmarkStepThroughputFilled(b *testing.B) {
	fill := 1_000_000
	if v, err := strconv.Atoi(os.Getenv("SAGAFLOW_BENCH_FILL")); err == nil && v >= 0 {
		fill = v
	}
	steps := max(b.N, 300)
	var rates [2]float64
	for i, n := range []int{0, fill} {
		pool, schema := pgtest.NewSchema(b)
		ctx := context.Background()
		_, err := migrations.Migrate(ctx, pool, schema)
		require.NoError(b, err)
		s := pgx.Identifier{schema}.Sanitize()
		if n > 0 {
			_, err = pool.Exec(ctx, `INSERT INTO `+s+`.saga_instances (id, saga_name, status, step_index, step_name, direction, state,
					version, created_at, updated_at, ended_at)
				SELECT gen_random_uuid(), 'bench', 'completed', 2, 'c', 'forward', '{"order_id":"x","done":["a","b","c"]}', 4,
					now() - interval '1 day' + g * interval '1 ms', now() - interval '1 day' + g * interval '1 ms',
					now() - interval '1 day' + g * interval '1 ms'
				FROM generate_series(1, $1) g`, n)
			require.NoError(b, err)
			_, err = pool.Exec(ctx, `INSERT INTO `+s+`.saga_history (saga_id, event, step_name, direction, epoch, attempt, at)
				SELECT i.id, e.event, e.step, 'forward', 0, 1, i.created_at FROM `+s+`.saga_instances i,
					(VALUES ('saga_started', 'a'), ('step_completed', 'a'), ('step_completed', 'b'), ('step_completed', 'c'),
						('saga_completed', NULL)) e(event, step)`)
			require.NoError(b, err)
			_, err = pool.Exec(ctx, `INSERT INTO `+s+`.inbox (consumer, key, processed_at)
				SELECT 'sagaflow.engine', i.id::text || '/' || st || '/forward/0', i.created_at
				FROM `+s+`.saga_instances i, unnest(ARRAY['a', 'b', 'c']) st`)
			require.NoError(b, err)
			_, err = pool.Exec(ctx, `VACUUM ANALYZE `+s+`.saga_instances, `+s+`.saga_history, `+s+`.inbox`)
			require.NoError(b, err)
		}
		rates[i], _, _ = engineRun(b, biggerPool(b, pool, 12), schema, 8, steps, saturatingLoad)
	}
	b.ReportMetric(rates[0], "empty_steps/s")
	b.ReportMetric(rates[1], "filled_steps/s")
	b.ReportMetric(rates[1]/rates[0], "ratio")
}

// BenchmarkSagaLatencyAtRate starts 3-step sagas at a fixed rate (an open
// loop: starts do not wait for sagas to end) and measures each saga's
// latency, from its start to its end in database time (created_at to
// ended_at). Set the rate with SAGAFLOW_BENCH_RATE (sagas per second,
// default 400: about half of the engine's peak on a 2-core machine) and the
// workers with SAGAFLOW_BENCH_WORKERS (default 8). b.N counts sagas.
func BenchmarkSagaLatencyAtRate(b *testing.B) {
	rate := 400
	if v, err := strconv.Atoi(os.Getenv("SAGAFLOW_BENCH_RATE")); err == nil && v > 0 {
		rate = v
	}
	workers := 8
	if v, err := strconv.Atoi(os.Getenv("SAGAFLOW_BENCH_WORKERS")); err == nil && v > 0 {
		workers = v
	}
	sagas := max(b.N, 300)
	pool, schema := pgtest.NewSchema(b)
	ctx := context.Background()
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(b, err)
	pool = biggerPool(b, pool, workers+16)
	e, err := saga.New(pool, &saga.Config{Schema: schema, Workers: workers, PollInterval: 50 * time.Millisecond, Logger: discardLogger()})
	require.NoError(b, err)
	step := func(_ context.Context, run *saga.StepRun, s *order) error {
		s.Done = append(s.Done, run.Step)
		return nil
	}
	def := saga.Define("bench", saga.Step[order]{Name: "a", Action: step}, saga.Step[order]{Name: "b", Action: step},
		saga.Step[order]{Name: "c", Action: step})
	require.NoError(b, e.Register(def))
	require.NoError(b, e.Start(ctx))
	defer func() { require.NoError(b, e.Stop(ctx)) }()

	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for range sagas {
		<-tick.C
		wg.Go(func() {
			_, err := saga.Start(ctx, e, def, order{OrderID: "x"}, nil)
			require.NoError(b, err)
		})
	}
	wg.Wait()
	offered := float64(sagas) / time.Since(start).Seconds()
	s := pgx.Identifier{schema}.Sanitize()
	waitForB(b, func() bool {
		var n int
		require.NoError(b, pool.QueryRow(ctx, "SELECT count(*) FROM "+s+".saga_instances WHERE status <> 'completed'").Scan(&n))
		return n == 0
	})
	b.StopTimer()
	rows, err := pool.Query(ctx, "SELECT extract(epoch FROM ended_at - created_at) FROM "+s+".saga_instances ORDER BY 1")
	require.NoError(b, err)
	secs, err := pgx.CollectRows(rows, pgx.RowTo[float64])
	require.NoError(b, err)
	pct := func(p float64) float64 { return secs[min(len(secs)-1, int(float64(len(secs))*p))] * 1000 }
	b.ReportMetric(offered, "sagas/s")
	b.ReportMetric(offered*3, "steps/s")
	b.ReportMetric(pct(0.50), "saga_p50_ms")
	b.ReportMetric(pct(0.99), "saga_p99_ms")
	b.ReportMetric(float64(e.Stats().Deferred)/float64(sagas*3), "deferred/step")
}

// saturatingLoad is the number of sagas kept in flight by the throughput
// benchmark: enough to keep every configuration busy.
const saturatingLoad = 256

func biggerPool(b *testing.B, small *pgxpool.Pool, size int) *pgxpool.Pool {
	cfg := small.Config().Copy()
	cfg.MaxConns = int32(size)
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(b, err)
	b.Cleanup(p.Close)
	return p
}

// rawBaseline runs steps transactions, each updating one row and inserting a
// history row and an outbox row, from conc goroutines.
func rawBaseline(b *testing.B, pool *pgxpool.Pool, schema string, conc, steps int) float64 {
	ctx := context.Background()
	s := pgx.Identifier{schema}.Sanitize()
	_, err := pool.Exec(ctx, `CREATE TABLE `+s+`.raw_state (id int PRIMARY KEY, version bigint NOT NULL, state jsonb NOT NULL) WITH (fillfactor = 80);
		CREATE TABLE `+s+`.raw_history (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, state_id int, event text, at timestamptz DEFAULT clock_timestamp());
		CREATE TABLE `+s+`.raw_outbox (id uuid PRIMARY KEY, topic text, payload bytea, created_at timestamptz DEFAULT now());
		INSERT INTO `+s+`.raw_state SELECT g, 1, '{"order_id":"x"}' FROM generate_series(0, 1023) g`)
	require.NoError(b, err)
	var next atomic.Int64
	start := time.Now()
	var wg sync.WaitGroup
	for w := range conc {
		wg.Go(func() {
			for i := next.Add(1); i <= int64(steps); i = next.Add(1) {
				id := (int(i)*conc + w) % 1024
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, `UPDATE `+s+`.raw_state SET version = version + 1, state = $2 WHERE id = $1`, id, []byte(`{"order_id":"x","done":["a"]}`)); err != nil {
						return err
					}
					if _, err := tx.Exec(ctx, `INSERT INTO `+s+`.raw_history (state_id, event) VALUES ($1, 'step_completed')`, id); err != nil {
						return err
					}
					_, err := tx.Exec(ctx, `INSERT INTO `+s+`.raw_outbox (id, topic, payload) VALUES ($1, 'commands', $2)`, uuid.Must(uuid.NewV7()), []byte(`{"saga_id":"x"}`))
					return err
				})
				require.NoError(b, err)
			}
		})
	}
	wg.Wait()
	return float64(steps) / time.Since(start).Seconds()
}

// engineRun keeps inflight sagas in flight on conc workers and measures steps
// per second and step-to-step latency.
func engineRun(b *testing.B, pool *pgxpool.Pool, schema string, conc, steps, inflight int) (float64, time.Duration, time.Duration) {
	return engineRunWith(b, pool, schema, conc, steps, inflight, nil)
}

// engineRunWith is engineRun with the engine's config changed by mod, when
// it is not nil.
func engineRunWith(b *testing.B, pool *pgxpool.Pool, schema string, conc, steps, inflight int,
	mod func(*saga.Config)) (float64, time.Duration, time.Duration) {
	return engineRunShaped(b, pool, schema, conc, steps, inflight, mod, runShape{})
}

// runShape varies the benchmark's saga (bench_concurrency_test.go).
type runShape struct {
	// keyed gives the definition a concurrency limit of 1 and each saga a
	// key of its own.
	keyed bool
	// stmt makes each step run one statement on run.Tx: with the step's
	// context (watched: the step's end would cancel it on the server), or
	// with context.Background() (not watched).
	stmt stmtMode
}

type stmtMode int

const (
	stmtNone stmtMode = iota
	stmtWatched
	stmtUnwatched
)

// engineRunShaped is engineRunWith with the saga shaped by shape.
func engineRunShaped(b *testing.B, pool *pgxpool.Pool, schema string, conc, steps, inflight int,
	mod func(*saga.Config), shape runShape) (float64, time.Duration, time.Duration) {
	ctx := context.Background()
	batch := saga.BatchSizeDefault
	if v, err := strconv.Atoi(os.Getenv("SAGAFLOW_BENCH_BATCH")); err == nil {
		batch = v
	}
	cfg := &saga.Config{Schema: schema, Workers: conc, BatchSize: batch, PollInterval: 50 * time.Millisecond, Logger: discardLogger()}
	if mod != nil {
		mod(cfg)
	}
	e, err := saga.New(pool, cfg)
	require.NoError(b, err)
	var done sync.Map // saga id -> chan struct{}
	step := func(last bool) saga.StepFunc[order] {
		return func(ctx context.Context, run *saga.StepRun, s *order) error {
			s.Done = append(s.Done, run.Step)
			if shape.stmt != stmtNone {
				if shape.stmt == stmtUnwatched {
					ctx = context.Background()
				}
				if _, err := run.Tx.Exec(ctx, "SELECT $1::int", len(s.Done)); err != nil {
					return err
				}
			}
			if last {
				if ch, ok := done.Load(run.SagaID); ok {
					close(ch.(chan struct{}))
				}
			}
			return nil
		}
	}
	def := saga.Define("bench",
		saga.Step[order]{Name: "a", Action: step(false)},
		saga.Step[order]{Name: "b", Action: step(false)},
		saga.Step[order]{Name: "c", Action: step(true)},
	)
	if shape.keyed {
		def.WithConcurrency(1)
	}
	require.NoError(b, e.Register(def))
	require.NoError(b, e.Start(ctx))
	defer func() {
		require.NoError(b, e.Stop(ctx))
		// Commands put back because another transaction held their saga:
		// work the engine did twice.
		b.ReportMetric(float64(e.Stats().Deferred)/float64(steps), "deferred/step")
	}()

	sagas := (steps + 2) / 3
	var next atomic.Int64
	var ids sync.Map
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for range inflight {
		wg.Go(func() {
			for i := next.Add(1); i <= int64(sagas); i = next.Add(1) {
				id := uuid.Must(uuid.NewV7())
				ch := make(chan struct{})
				done.Store(id, ch)
				opts := &saga.StartOpts{ID: id}
				if shape.keyed {
					opts.ConcurrencyKey = id.String()
				}
				_, err := saga.Start(ctx, e, def, order{OrderID: "x"}, opts)
				require.NoError(b, err)
				ids.Store(id, true)
				<-ch
			}
		})
	}
	wg.Wait()
	// Wait for the last commits (the signal fires just before them).
	waitForB(b, func() bool {
		var n int
		require.NoError(b, pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{schema}.Sanitize()+".saga_instances WHERE status <> 'completed'").Scan(&n))
		return n == 0
	})
	elapsed := time.Since(start)
	b.StopTimer()

	// Step-to-step latency in database time: from one history entry of a
	// saga to the next.
	rows, err := pool.Query(ctx, `SELECT extract(epoch FROM at - lag(at) OVER (PARTITION BY saga_id ORDER BY id))
		FROM `+pgx.Identifier{schema}.Sanitize()+`.saga_history WHERE event IN ('saga_started', 'step_completed')`)
	require.NoError(b, err)
	gaps, err := pgx.CollectRows(rows, pgx.RowTo[*float64])
	require.NoError(b, err)
	var lat []time.Duration
	for _, g := range gaps {
		if g != nil {
			lat = append(lat, time.Duration(*g*float64(time.Second)))
		}
	}
	slices.Sort(lat)
	pct := func(p float64) time.Duration {
		if len(lat) == 0 {
			return 0
		}
		return lat[min(len(lat)-1, int(float64(len(lat))*p))]
	}
	return float64(sagas*3) / elapsed.Seconds(), pct(0.50), pct(0.99)
}

func waitForB(b *testing.B, cond func() bool) {
	deadline := time.Now().Add(2 * time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			b.Fatal("timed out waiting for sagas to complete")
		}
		time.Sleep(5 * time.Millisecond)
	}
}
