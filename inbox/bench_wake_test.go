package inbox_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/outbox"
)

// BenchmarkProcessWritingTheOutbox runs, from 32 goroutines, messages whose
// handler writes one outbox row: through Process, which wakes the relay
// after the commit, and through ProcessTx in a transaction of the caller's,
// where the notification goes with the commit (as before Process deferred
// it). go test -run '^$' -bench ProcessWritingTheOutbox -benchtime 5000x ./inbox/
func BenchmarkProcessWritingTheOutbox(b *testing.B) {
	for _, mode := range []string{"notify-after-commit", "notify-in-commit"} {
		b.Run(mode, func(b *testing.B) {
			bu := setup(b)
			ob, err := outbox.New(bu.pool, bu.schema)
			if err != nil {
				b.Fatal(err)
			}
			handler := func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
				return ob.InsertTx(ctx, tx, outbox.Message{Topic: "replies", Key: m.ID, Type: "done", Payload: []byte("{}")})
			}
			var seq atomic.Int64
			ctx := context.Background()
			b.SetParallelism(16) // 32 goroutines on 2 cores
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					msg := inbox.Message{ID: fmt.Sprintf("m-%d", seq.Add(1)), Topic: "orders"}
					var err error
					if mode == "notify-after-commit" {
						_, err = bu.in.Process(ctx, msg, handler)
					} else {
						err = pgx.BeginTxFunc(ctx, bu.pool, pgx.TxOptions{}, func(tx pgx.Tx) error {
							_, err := bu.in.ProcessTx(ctx, tx, msg, handler)
							return err
						})
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
