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
	pool   *pgxpool.Pool
	schema string
	s      string // quoted schema
	next   atomic.Int64
	rows   int
	m      *meter
}

func newRaw(ctx context.Context, o *runOpts) (*rawSystem, error) {
	app := "bench-raw-" + randomSuffix()
	pool, err := connect(ctx, app, min(max(o.Conc, 1), rawMaxConns))
	if err != nil {
		return nil, err
	}
	r := &rawSystem{pool: pool, schema: "bench_" + randomSuffix(), rows: max(o.Conc, 1024), m: &meter{pool: pool, app: app}}
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

func (r *rawSystem) meter() *meter { return r.m }
func (r *rawSystem) note() string {
	return fmt.Sprintf("pool=%d connections", r.pool.Config().MaxConns)
}

func (r *rawSystem) close() {
	dropSchema(context.Background(), r.pool, r.schema)
	r.pool.Close()
}
