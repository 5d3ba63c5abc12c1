package review33_test

import (
	"context"
	"fmt"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/outbox"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/relay"
)

// countWriter takes every write whose ctx has not ended, as a broker
// client does, and counts the messages.
type countWriter struct{ n atomic.Int64 }

func (w *countWriter) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	w.n.Add(int64(len(msgs)))
	return nil
}
func (w *countWriter) Close() error { return nil }

// TestLogicalRelayConfigAtItsExtremes: on a throwaway server with
// wal_level=logical, bad LogicalConfig values and slot or publication names
// get an error naming what is wrong (at NewLogical or at Setup), never a
// panic or a hang, and no slot is left behind by a refused Setup.
func TestLogicalRelayConfigAtItsExtremes(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Second)
	defer cancel()
	srv, err := pgtest.StartLogicalServer(ctx)
	if err != nil {
		t.Skipf("no throwaway PostgreSQL with wal_level=logical: %v", err)
	}
	t.Cleanup(func() { _ = srv.Stop(context.Background()) })
	pool, err := pgxpool.New(ctx, srv.ConnString())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	schema := "r33logical"
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	slots := func() []string {
		rows, err := pool.Query(ctx, "SELECT slot_name FROM pg_replication_slots")
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for rows.Next() {
			var s string
			_ = rows.Scan(&s)
			out = append(out, s)
		}
		return out
	}
	type tc struct {
		name   string
		cfg    relay.LogicalConfig
		expect string // "refuse": NewLogical or Setup fails naming it; "publish": 3 rows go
	}
	cases := []tc{
		{"batch-neg", relay.LogicalConfig{BatchSize: -1}, "refuse"},
		{"batch-max", relay.LogicalConfig{BatchSize: math.MaxInt}, "refuse"},
		{"maxmsg-neg", relay.LogicalConfig{MaxMessageBytes: -1}, "refuse"},
		{"schema-nul", relay.LogicalConfig{Schema: "a\x00b", Slot: "r33_schemanul"}, "refuse"},
		{"schema-big", relay.LogicalConfig{Schema: big, Slot: "r33_schemabig"}, "refuse"},
		{"slot-nul", relay.LogicalConfig{Slot: "a\x00b"}, "refuse"},
		{"slot-upper", relay.LogicalConfig{Slot: "Slot_A"}, "refuse"},
		{"slot-space", relay.LogicalConfig{Slot: "a b"}, "refuse"},
		{"slot-dash", relay.LogicalConfig{Slot: "a-b"}, "refuse"},
		{"slot-utf8", relay.LogicalConfig{Slot: "a\xffb"}, "refuse"},
		{"slot-quote", relay.LogicalConfig{Slot: "a'; DROP TABLE x; --"}, "refuse"},
		{"pub-nul", relay.LogicalConfig{Publication: "a\x00b", Slot: "r33_pubnul"}, "refuse"},
		{"pub-utf8", relay.LogicalConfig{Publication: "a\xffb", Slot: "r33_pubutf8"}, "refuse"},
		{"timeout-max", relay.LogicalConfig{PublishTimeout: math.MaxInt64}, "publish"},
		{"backoff-neg", relay.LogicalConfig{OutageBackoffMax: -1}, "refuse"}, // refused since F3's fix: a negative cap waited not at all
		{"backoff-max", relay.LogicalConfig{OutageBackoffMax: math.MaxInt64}, "publish"},
		{"status-max", relay.LogicalConfig{StatusInterval: math.MaxInt64}, "publish"},
		{"batch-1", relay.LogicalConfig{BatchSize: 1}, "publish"},
		{"slot-64", relay.LogicalConfig{Slot: strings.Repeat("s", 64)}, "publish"},
		{"slot-big", relay.LogicalConfig{Slot: big}, "publish"},
		{"pub-quote", relay.LogicalConfig{Publication: "a\"b", Slot: "r33_pubquote"}, "publish"},
		{"pub-big", relay.LogicalConfig{Publication: big, Slot: "r33_pubbig"}, "refuse"}, // refused since F4's fix: PostgreSQL would cut it to 63 bytes
		{"pub-63", relay.LogicalConfig{Publication: strings.Repeat("P", 63), Slot: "r33_pub63"}, "publish"},
		{"timeout-neg", relay.LogicalConfig{PublishTimeout: -1}, "refuse"}, // F3, fixed
		{"timeout-1ns", relay.LogicalConfig{PublishTimeout: 1}, "refuse"},
		{"timeout-min", relay.LogicalConfig{PublishTimeout: relay.PublishTimeoutMin}, "publish"},
		{"status-neg", relay.LogicalConfig{StatusInterval: -1}, "refuse"},
		{"status-1ns", relay.LogicalConfig{StatusInterval: 1}, "refuse"},
		{"status-min", relay.LogicalConfig{StatusInterval: relay.StatusIntervalMin}, "publish"},
		{"pub-upper", relay.LogicalConfig{Publication: "Pub_A", Slot: "r33_pubupper"}, "publish"}, // F4, fixed
	}
	for _, c := range cases {
		cfg := c.cfg
		if cfg.Schema == "" {
			cfg.Schema = schema
		}
		cfg.Logger = discard
		w := &countWriter{}
		var lr *relay.LogicalRelay
		err, hung := bounded(10*time.Second, func() error {
			var e error
			lr, e = relay.NewLogical(pool, srv.ConnString(), w, &cfg)
			return e
		})
		if hung {
			t.Fatalf("%s: NewLogical hung", c.name)
		}
		if err == nil {
			err, hung = bounded(10*time.Second, func() error { return lr.Setup(ctx) })
			if hung {
				t.Fatalf("%s: Setup hung", c.name)
			}
		}
		switch {
		case c.expect == "refuse":
			if err == nil || strings.HasPrefix(err.Error(), "PANIC") {
				t.Errorf("%s: NewLogical and Setup returned %v, want an error", c.name, err)
			}
			if s := slots(); len(s) != 0 {
				t.Errorf("%s: a refused Setup left slots %q", c.name, s)
			}
		case err != nil:
			t.Errorf("%s: %v", c.name, err)
		default:
			rctx, rcancel := context.WithTimeout(ctx, 8*time.Second)
			go func() {
				time.Sleep(300 * time.Millisecond)
				insert(t, pool, schema, 3, "r33.topic")
				for rctx.Err() == nil && w.n.Load() < 3 {
					time.Sleep(20 * time.Millisecond)
				}
				rcancel()
			}()
			rerr, hung := bounded(20*time.Second, func() error { return lr.Run(rctx) })
			rcancel()
			if hung || (rerr != nil && strings.HasPrefix(rerr.Error(), "PANIC")) {
				t.Fatalf("%s: Run: %v (hung %v)", c.name, rerr, hung)
			}
			if n := w.n.Load(); n != 3 {
				t.Errorf("%s (%s): Setup took it, but Run published %d of 3 rows in 8 s; Run returned %v", c.name, c.expect, n, rerr)
			}
		}
		_, _ = pool.Exec(ctx, "DELETE FROM "+schema+".outbox")
		for _, s := range slots() {
			waitFor(t, 10*time.Second, "slot "+short(s)+" to drop", func() bool {
				_, err := pool.Exec(ctx, "SELECT pg_drop_replication_slot($1)", s)
				return err == nil
			})
		}
		_, _ = pool.Exec(ctx, `DROP PUBLICATION IF EXISTS sagaflow_relay, "Pub_A", pub_a, "a""b", `+pgx.Identifier{strings.Repeat("P", 63)}.Sanitize())
	}
}

// insert writes n outbox relay messages on topic.
func insert(t testing.TB, pool *pgxpool.Pool, schema string, n int, topic string) {
	ob, err := outbox.New(pool, schema)
	if err != nil {
		t.Error(err)
		return
	}
	ctx := context.Background()
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for i := range n {
			if err := ob.InsertTx(ctx, tx, outbox.Message{Topic: topic, Type: "Evt", Key: fmt.Sprintf("k%d", i), Payload: []byte("{}")}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}
}
