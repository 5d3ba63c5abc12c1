package main

import (
	"context"
	"fmt"
	"sync/atomic"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// rawMaxConns bounds the raw baseline's pool: beyond a few dozen
// connections two cores only queue.
const rawMaxConns = 32

// rawSystem is the baseline: the SQL of one step of saga/bench_test.go's
// rawBaseline — update the instance's row, insert a history row, insert an
// outbox row — one transaction per step, three steps per "saga", with pgx
// and no engine.
type rawSystem struct {
	// pipelined sends each step's transaction as one batch: its three
	// statements go in one round trip and run in one implicit transaction
	// (the extended protocol runs everything before a Sync as one).
	pipelined bool
	pool      *pgxpool.Pool
	schema    string
	s         string // quoted schema
	next      atomic.Int64
	rows      int
	m         *meter
}

func newRaw(ctx context.Context, o *runOpts, pipelined bool) (*rawSystem, error) {
	app := "bench-raw-" + randomSuffix()
	pool, err := connect(ctx, app, min(max(o.Conc, 1), rawMaxConns))
	if err != nil {
		return nil, err
	}
	r := &rawSystem{pipelined: pipelined, pool: pool, schema: "bench_" + randomSuffix(), rows: max(o.Conc, 1024), m: &meter{pool: pool, app: app}}
	r.s = pgx.Identifier{r.schema}.Sanitize()
	if err := createSchema(ctx, pool, r.schema); err != nil {
		pool.Close()
		return nil, err
	}
	_, err = pool.Exec(ctx, `CREATE TABLE `+r.s+`.raw_state (id int PRIMARY KEY, version bigint NOT NULL, state jsonb NOT NULL) WITH (fillfactor = 80);
		CREATE TABLE `+r.s+`.raw_history (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, state_id int, event text, at timestamptz DEFAULT clock_timestamp());
		CREATE TABLE `+r.s+`.raw_outbox (id uuid PRIMARY KEY, topic text, payload bytea, created_at timestamptz DEFAULT now());
		INSERT INTO `+r.s+`.raw_state SELECT g, 1, '{"order_id":"x"}' FROM generate_series(0, `+fmt.Sprint(r.rows-1)+`) g`)
	if err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

var rawStates = [3][]byte{
	[]byte(`{"order_id":"x","done":["a"]}`),
	[]byte(`{"order_id":"x","done":["a","b"]}`),
	[]byte(`{"order_id":"x","done":["a","b","c"]}`),
}

// run does the three steps of one instance, each in its own transaction.
func (r *rawSystem) run(ctx context.Context) error {
	id := int(r.next.Add(1)) % r.rows
	if r.pipelined {
		return r.runPipelined(ctx, id)
	}
	for step := range 3 {
		err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `UPDATE `+r.s+`.raw_state SET version = version + 1, state = $2 WHERE id = $1`, id, rawStates[step]); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO `+r.s+`.raw_history (state_id, event) VALUES ($1, 'step_completed')`, id); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO `+r.s+`.raw_outbox (id, topic, payload) VALUES ($1, 'commands', $2)`, uuid.Must(uuid.NewV7()), []byte(`{"saga_id":"x"}`))
			return err
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// runPipelined does the same three steps, each step's statements as one
// batch: one round trip and one transaction per step.
func (r *rawSystem) runPipelined(ctx context.Context, id int) error {
	for step := range 3 {
		b := &pgx.Batch{}
		b.Queue(`UPDATE `+r.s+`.raw_state SET version = version + 1, state = $2 WHERE id = $1`, id, rawStates[step])
		b.Queue(`INSERT INTO `+r.s+`.raw_history (state_id, event) VALUES ($1, 'step_completed')`, id)
		b.Queue(`INSERT INTO `+r.s+`.raw_outbox (id, topic, payload) VALUES ($1, 'commands', $2)`, uuid.Must(uuid.NewV7()), []byte(`{"saga_id":"x"}`))
		if err := r.pool.SendBatch(ctx, b).Close(); err != nil {
			return err
		}
	}
	return nil
}

func (r *rawSystem) meter() *meter { return r.m }
func (r *rawSystem) note() string {
	if r.pipelined {
		return fmt.Sprintf("pool=%d connections, each step one pipelined batch (one round trip)", r.pool.Config().MaxConns)
	}
	return fmt.Sprintf("pool=%d connections, statement by statement", r.pool.Config().MaxConns)
}

func (r *rawSystem) close() {
	dropSchema(context.Background(), r.pool, r.schema)
	r.pool.Close()
}
