package outbox_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/outbox"
)

// BenchmarkInsertTxCommits runs, from 32 goroutines, transactions that
// each write one outbox row: notifying in the commit, and with the wake-up
// after it (WakeAfterCommit). go test -run '^$' -bench InsertTxCommits
// -benchtime 3000x ./outbox/
func BenchmarkInsertTxCommits(b *testing.B) {
	for _, mode := range []string{"notify-in-commit", "wake-after-commit"} {
		b.Run(mode, func(b *testing.B) {
			ctx := context.Background()
			pool, schema := pgtest.NewSchema(b)
			if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
				b.Fatal(err)
			}
			ob, err := outbox.New(pool, schema)
			if err != nil {
				b.Fatal(err)
			}
			b.SetParallelism(16) // 32 goroutines on 2 cores
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					ctx, wake := ctx, func(context.Context, outbox.Execer) error { return nil }
					if mode == "wake-after-commit" {
						ctx, wake = outbox.WakeAfterCommit(ctx)
					}
					err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
						return ob.InsertTx(ctx, tx, outbox.Message{Topic: "orders.events", Key: "k", Type: "T", Payload: []byte("{}")})
					})
					if err == nil {
						err = wake(ctx, pool)
					}
					if err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
