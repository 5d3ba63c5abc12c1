package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/saga"
)

// The retention scenario (issue #17, item 6): what retention's deletes of a
// large backlog cost the engine's throughput. Two schemas are pre-filled
// identically with finished sagas past every retention window (Age
// retentionAge); the engine (sagaflow-pg, a child process as in compare)
// runs its closed loop on one of them while, in the parent, either nothing
// else runs ("idle") or [saga.Engine.RunRetention] deletes the backlog
// ("deleting", one window after another until the backlog is gone). The
// order is deleting on schema 2, idle twice on schema 1, deleting on schema
// 1, so that neither condition always comes first. After each delete the
// engine runs once more before a VACUUM ("deleted") and once after it
// ("vacuumed").
//
// Before each window (outside it) the tables of -vacuum-before are
// vacuumed, by default the two that the engine's own work leaves dead rows
// in (its consumed commands, its saga updates): on a server with
// autovacuum off, as the project's test server is, they would otherwise
// bloat from one window to the next whatever retention does, and the later
// windows would be slower for that alone.

// retentionAge puts the pre-filled sagas past the 30-day saga retention,
// and so past the outbox's and the inbox's too.
const retentionAge = 40 * 24 * time.Hour

// retentionTables are the tables retention deletes from, with their sizes
// reported before and after; the outbox last.
var retentionTables = []string{"saga_instances", "saga_history", "inbox", "outbox"}

type retentionOpts struct {
	sagas     int
	outbox    int
	conc      int
	window    time.Duration
	batch     int
	keep      bool
	out       string
	afterRuns bool
	// vacuum are the tables to VACUUM before each window (outside it).
	vacuum []string
}

// RetentionReport is what bench retention prints and writes.
type RetentionReport struct {
	Machine Machine `json:"machine"`
	Sagas   int     `json:"sagas"`
	// Rows counts the backlog of each schema, per table.
	Rows  []map[string]int64 `json:"rows"`
	Batch int                `json:"retention_batch"`
	// Autovacuum is the server's setting: with it off, the tables of
	// -vacuum-before are vacuumed before each window instead.
	Autovacuum string            `json:"autovacuum"`
	Vacuum     string            `json:"vacuum_before_each_window"`
	Prefill    []string          `json:"prefill"`
	Windows    []RetentionWindow `json:"windows"`
	Deletes    []RetentionDelete `json:"deletes"`
}

// RetentionWindow is one measured run of the engine and what retention
// deleted meanwhile.
type RetentionWindow struct {
	Schema    string `json:"schema"`
	Condition string `json:"condition"` // idle, deleting, deleted, vacuumed
	Sample    Sample `json:"sample"`
	// VacuumSeconds is the time the VACUUM before the window took.
	VacuumSeconds float64 `json:"vacuum_seconds,omitempty"`
	// Deleted counts the rows deleted from each table in the window, from
	// pg_stat_user_tables; not the outbox's, whose consumed commands the
	// engine deletes too.
	Deleted map[string]int64 `json:"deleted,omitempty"`
	LoadAvg string           `json:"loadavg"`
}

// RetentionDelete is one full delete of a schema's backlog.
type RetentionDelete struct {
	Schema        string                `json:"schema"`
	Seconds       float64               `json:"seconds"`
	Result        saga.RetentionResult  `json:"result"`
	Rows          int64                 `json:"rows"` // every row, history included (from Result and saga_history's n_tup_del)
	RowsPerSecond float64               `json:"rows_per_second"`
	VacuumSeconds float64               `json:"vacuum_seconds"`
	Before        map[string]tableSizes `json:"before"`
	After         map[string]tableSizes `json:"after"`
	Vacuumed      map[string]tableSizes `json:"vacuumed"`
	Error         string                `json:"error,omitempty"`
}

type tableSizes struct {
	Rows   int64 `json:"rows"` // n_live_tup
	Dead   int64 `json:"dead"` // n_dead_tup
	Total  int64 `json:"total_bytes"`
	Heap   int64 `json:"heap_bytes"`
	Index  int64 `json:"index_bytes"`
	Delete int64 `json:"n_tup_del"`
}

func retentionMain(args []string) error {
	fs := flag.NewFlagSet("retention", flag.ExitOnError)
	var o retentionOpts
	fs.IntVar(&o.sagas, "sagas", 1_000_000, "finished sagas past their retention per schema (with -outbox 3, 12 rows each)")
	fs.IntVar(&o.outbox, "outbox", 3, "published outbox messages per saga (0 to 3)")
	fs.IntVar(&o.conc, "conc", 256, "sagas in flight")
	fs.DurationVar(&o.window, "window", time.Minute, "measured window of each run")
	fs.IntVar(&o.batch, "batch", saga.RetentionBatchDefault, "Config.RetentionBatch")
	fs.BoolVar(&o.afterRuns, "after", true, "measure the engine after each delete, before and after VACUUM")
	vacuum := fs.String("vacuum-before", "outbox,saga_instances", "tables to VACUUM before each window, as autovacuum would between them (\"\" for none)")
	fs.BoolVar(&o.keep, "keep", false, "keep the schemas")
	fs.StringVar(&o.out, "out", "", "write the report as JSON here")
	_ = fs.Parse(args)
	o.vacuum = splitList(*vacuum)
	if o.outbox < 0 || o.outbox > 3 {
		return fmt.Errorf("-outbox %d: 0 to 3", o.outbox)
	}
	ctx := context.Background()
	pool, err := connect(ctx, "bench-retention", 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	rep := RetentionReport{Machine: describeMachine(ctx, ""), Sagas: o.sagas, Batch: o.batch, Vacuum: *vacuum}
	if err := pool.QueryRow(ctx, "SELECT current_setting('autovacuum')").Scan(&rep.Autovacuum); err != nil {
		return err
	}
	progressf("autovacuum=%s; VACUUM before each window: %q", rep.Autovacuum, *vacuum)
	schemas := []string{"bench_retention_1_" + randomSuffix(), "bench_retention_2_" + randomSuffix()}
	if !o.keep {
		defer func() {
			for _, s := range schemas {
				dropSchema(context.Background(), pool, s)
			}
		}()
	}
	for _, s := range schemas {
		progressf("pre-filling %s with %d finished sagas, %d days old...", s, o.sagas, retentionAge/(24*time.Hour))
		d, err := prefillHistory(ctx, pool, s, o.sagas, historyShape{Age: retentionAge, Outbox: o.outbox})
		if err != nil {
			return err
		}
		rows, err := countRows(ctx, pool, s)
		if err != nil {
			return err
		}
		rep.Rows = append(rep.Rows, rows)
		line := fmt.Sprintf("%s: %d sagas in %s; rows %v", s, o.sagas, d.Round(time.Second), rows)
		progressf("%s", line)
		rep.Prefill = append(rep.Prefill, line)
	}
	idle := func(s string) {
		rep.Windows = append(rep.Windows, retentionWindow(ctx, pool, &o, s, "idle"))
	}
	del := func(s string) error {
		d, ws, err := deleteBacklog(ctx, pool, &o, s)
		rep.Windows = append(rep.Windows, ws...)
		rep.Deletes = append(rep.Deletes, d)
		return err
	}
	// B A A B: deleting on schema 2, idle twice on schema 1 (its backlog
	// still whole), deleting on schema 1.
	if err := del(schemas[1]); err != nil {
		return err
	}
	idle(schemas[0])
	idle(schemas[0])
	if err := del(schemas[0]); err != nil {
		return err
	}
	printRetention(&rep)
	if o.out != "" {
		b, err := json.MarshalIndent(rep, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(o.out, append(b, '\n'), 0o644); err != nil {
			return err
		}
		progressf("wrote %s", o.out)
	}
	return nil
}

// deleteBacklog runs RunRetention on schema until it returns, measuring the
// engine in one window after another meanwhile; then, with -after, once
// more, VACUUM, and once more.
func deleteBacklog(ctx context.Context, pool *pgxpool.Pool, o *retentionOpts, schema string) (RetentionDelete, []RetentionWindow, error) {
	d := RetentionDelete{Schema: schema}
	var ws []RetentionWindow
	var err error
	if d.Before, err = sizesOf(ctx, pool, schema); err != nil {
		return d, nil, err
	}
	e, err := saga.New(pool, &saga.Config{Schema: schema, RetentionBatch: o.batch, Logger: discard})
	if err != nil {
		return d, nil, err
	}
	type outcome struct {
		res  saga.RetentionResult
		err  error
		took time.Duration
	}
	done := make(chan outcome, 1)
	start := time.Now()
	progressf("%s: retention started", schema)
	go func() {
		res, err := e.RunRetention(ctx)
		done <- outcome{res, err, time.Since(start)}
		progressf("%s: retention done in %s", schema, time.Since(start).Round(time.Second))
	}()
	var out outcome
	for running := true; running; {
		ws = append(ws, retentionWindow(ctx, pool, o, schema, "deleting"))
		select {
		case out = <-done:
			running = false
		default:
		}
	}
	d.Seconds = out.took.Seconds()
	d.Result = out.res
	if out.err != nil {
		d.Error = out.err.Error()
	}
	if d.After, err = sizesOf(ctx, pool, schema); err != nil {
		return d, ws, err
	}
	d.Rows = d.Result.Messages + d.Result.InboxKeys + d.Result.Sagas + d.Result.Signals +
		d.After["saga_history"].Delete - d.Before["saga_history"].Delete
	d.RowsPerSecond = float64(d.Rows) / d.Seconds
	progressf("%s: retention deleted %d rows in %.0f s (%.0f rows/s): %+v", schema, d.Rows, d.Seconds, d.RowsPerSecond, d.Result)
	if o.afterRuns {
		ws = append(ws, retentionWindow(ctx, pool, o, schema, "deleted"))
	}
	vstart := time.Now()
	for _, t := range retentionTables {
		if _, err := pool.Exec(ctx, "VACUUM (ANALYZE) "+pgx.Identifier{schema, t}.Sanitize()); err != nil {
			return d, ws, fmt.Errorf("vacuum %s.%s: %w", schema, t, err)
		}
	}
	d.VacuumSeconds = time.Since(vstart).Seconds()
	if d.Vacuumed, err = sizesOf(ctx, pool, schema); err != nil {
		return d, ws, err
	}
	progressf("%s: VACUUM in %.0f s", schema, d.VacuumSeconds)
	if o.afterRuns {
		ws = append(ws, retentionWindow(ctx, pool, o, schema, "vacuumed"))
	}
	return d, ws, nil
}

// retentionWindow measures the engine on schema in a child process, as
// compare does, and counts the rows deleted from each table meanwhile.
func retentionWindow(ctx context.Context, pool *pgxpool.Pool, o *retentionOpts, schema, condition string) RetentionWindow {
	var r runOpts
	rfs := flag.NewFlagSet("", flag.ContinueOnError)
	r.flags(rfs)
	_ = rfs.Parse(nil)
	r.System, r.Scenario, r.Conc, r.Schema, r.History = sysSagaflowPG, scenarioHistory, o.conc, schema, o.sagas
	r.Window, r.WindowMax, r.TimeBox = o.window, o.window, time.Minute
	w := RetentionWindow{Schema: schema, Condition: condition}
	vstart := time.Now()
	for _, t := range o.vacuum {
		if _, err := pool.Exec(ctx, "VACUUM "+pgx.Identifier{schema, t}.Sanitize()); err != nil {
			w.Sample.Error = fmt.Sprintf("vacuum %s.%s: %v", schema, t, err)
			return w
		}
	}
	w.VacuumSeconds = time.Since(vstart).Seconds()
	before, _ := sizesOf(ctx, pool, schema)
	w.LoadAvg = loadAvg()
	w.Sample = spawn(ctx, r)
	if after, err := sizesOf(ctx, pool, schema); err == nil && condition == "deleting" {
		w.Deleted = map[string]int64{}
		for _, t := range retentionTables[:3] {
			w.Deleted[t] = after[t].Delete - before[t].Delete
		}
	}
	progressf("%-8s %s: %.0f steps/s, p50 %.1f ms, p99 %.1f ms, deleted %v, vacuum before %.1f s, load %s %s",
		condition, schema, w.Sample.Rate, w.Sample.P50Ms, w.Sample.P99Ms, w.Deleted, w.VacuumSeconds, w.LoadAvg, w.Sample.Error)
	return w
}

// countRows counts the rows of retention's tables in schema.
func countRows(ctx context.Context, pool *pgxpool.Pool, schema string) (map[string]int64, error) {
	out := map[string]int64{}
	for _, t := range retentionTables {
		var n int64
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{schema, t}.Sanitize()).Scan(&n); err != nil {
			return nil, fmt.Errorf("count %s.%s: %w", schema, t, err)
		}
		out[t] = n
		out["all"] += n
	}
	return out, nil
}

// sizesOf reads the sizes and row counts of retention's tables in schema.
// The statistics' counters lag a transaction's end by up to a second.
func sizesOf(ctx context.Context, pool *pgxpool.Pool, schema string) (map[string]tableSizes, error) {
	out := map[string]tableSizes{}
	rows, err := pool.Query(ctx, `SELECT relname, n_live_tup, n_dead_tup, n_tup_del,
			pg_total_relation_size(relid), pg_relation_size(relid), pg_indexes_size(relid)
		FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = ANY($2)`, schema, retentionTables)
	if err != nil {
		return nil, fmt.Errorf("sizes of %s: %w", schema, err)
	}
	defer rows.Close()
	for rows.Next() {
		var name string
		var t tableSizes
		if err := rows.Scan(&name, &t.Rows, &t.Dead, &t.Delete, &t.Total, &t.Heap, &t.Index); err != nil {
			return nil, err
		}
		out[name] = t
	}
	return out, rows.Err()
}

// progressf prints a line of progress, as waits' progress does.
func progressf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s retention: %s\n", time.Now().UTC().Format("15:04:05"), fmt.Sprintf(format, args...))
}

func printRetention(r *RetentionReport) {
	fmt.Printf("retention: %d sagas per schema, past their windows; RetentionBatch %d; autovacuum=%s, VACUUM before each window: %q\n",
		r.Sagas, r.Batch, r.Autovacuum, r.Vacuum)
	for _, p := range r.Prefill {
		fmt.Println("  pre-filled", p)
	}
	fmt.Printf("%-9s %-30s %10s %8s %8s %9s %s\n", "condition", "schema", "steps/s", "p50 ms", "p99 ms", "vacuum s", "rows deleted in the window")
	for _, w := range r.Windows {
		fmt.Printf("%-9s %-30s %10.0f %8.1f %8.1f %9.1f %v %s\n", w.Condition, w.Schema, w.Sample.Rate, w.Sample.P50Ms, w.Sample.P99Ms, w.VacuumSeconds, w.Deleted, w.Sample.Error)
	}
	for _, d := range r.Deletes {
		fmt.Printf("delete %s: %d rows in %.0f s (%.0f rows/s), VACUUM %.0f s %s\n", d.Schema, d.Rows, d.Seconds, d.RowsPerSecond, d.VacuumSeconds, d.Error)
		for _, t := range retentionTables {
			fmt.Printf("  %-15s total MB before %8.0f  after delete %8.0f  after VACUUM %8.0f  (index MB %6.0f → %6.0f → %6.0f)\n", t,
				mb(d.Before[t].Total), mb(d.After[t].Total), mb(d.Vacuumed[t].Total), mb(d.Before[t].Index), mb(d.After[t].Index), mb(d.Vacuumed[t].Index))
		}
	}
}

func mb(b int64) float64 { return float64(b) / (1 << 20) }
