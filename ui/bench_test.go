package ui_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/ui"
)

// BenchmarkPages times each page, server side, on SAGAFLOW_UI_BENCH_SAGAS
// generated sagas (default 200,000) with five history entries each; or, with
// SAGAFLOW_UI_BENCH_SCHEMA, on the sagas already in that schema of the test
// server (generated once, for repeated runs at a million sagas).
func BenchmarkPages(b *testing.B) {
	ctx := context.Background()
	if schema := os.Getenv("SAGAFLOW_UI_BENCH_SCHEMA"); schema != "" {
		pool, err := pgxpool.New(ctx, pgtest.ConnString(b))
		require.NoError(b, err)
		defer pool.Close()
		benchPages(b, pool, schema)
		return
	}
	n := 200_000
	if s := os.Getenv("SAGAFLOW_UI_BENCH_SAGAS"); s != "" {
		var err error
		n, err = strconv.Atoi(s)
		require.NoError(b, err)
	}
	pool, schema := pgtest.NewSchema(b)
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(b, err)
	q := pgx.Identifier{schema}.Sanitize()
	_, err = pool.Exec(ctx, `INSERT INTO `+q+`.saga_instances
		(id, saga_name, business_key, status, step_index, step_name, direction, state, last_error, last_error_code, failed_step, created_at)
		SELECT gen_random_uuid(), 'checkout' || (i % 5), 'order-' || i,
			(ARRAY['completed','completed','completed','compensated','failed','running'])[i % 6 + 1], 1, 'charge', 'forward',
			'{"order":"x"}', CASE WHEN i % 6 >= 3 THEN 'declined' END, CASE WHEN i % 6 >= 3 THEN 'card_declined' END,
			CASE WHEN i % 6 >= 3 THEN 'charge' END, now() - i * interval '10 milliseconds'
		FROM generate_series(1, $1::int) i`, n)
	require.NoError(b, err)
	_, err = pool.Exec(ctx, `INSERT INTO `+q+`.saga_history (saga_id, event, step_name, direction, epoch, attempt, at)
		SELECT s.id, e.event, 'charge', 'forward', 0, 1, s.created_at
		FROM `+q+`.saga_instances s,
			(VALUES ('saga_started'), ('step_completed'), ('step_completed'), ('step_failed'), ('saga_compensated')) e(event)`)
	require.NoError(b, err)
	for _, tbl := range []string{"saga_instances", "saga_history"} {
		_, err = pool.Exec(ctx, "VACUUM ANALYZE "+q+"."+tbl)
		require.NoError(b, err)
	}
	benchPages(b, pool, schema)
}

func benchPages(b *testing.B, pool *pgxpool.Pool, schema string) {
	ctx := context.Background()
	q := pgx.Identifier{schema}.Sanitize()
	var failed string
	require.NoError(b, pool.QueryRow(ctx, `SELECT id::text FROM `+q+`.saga_instances WHERE status = 'failed'
		ORDER BY created_at LIMIT 1`).Scan(&failed))
	engine, err := saga.New(pool, &saga.Config{Schema: schema, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(b, err)
	h, err := ui.New(pool, engine, &ui.Config{Schema: schema, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(b, err)

	for _, page := range []struct{ name, path string }{
		{"overview", "/"},
		{"list", "/sagas"},
		{"list_failed_by_code", "/sagas?status=failed&code=card_declined"},
		{"list_by_key", "/sagas?name=checkout1&key=order-101"},
		{"saga", "/sagas/" + failed},
	} {
		b.Run(page.name, func(b *testing.B) {
			for b.Loop() {
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, page.path, nil))
				if rec.Code != http.StatusOK {
					b.Fatalf("%s: %d %s", page.path, rec.Code, rec.Body.String())
				}
			}
		})
	}
}
