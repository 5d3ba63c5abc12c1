package review18

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/wire"
)

// consume runs r's participant on topic in group with BatchSize 32 and
// short retries until the test ends, and returns the consumer.
func (r *participantRig) consume(t *testing.T, kc *kafkatest.Cluster, topic, group string) *inbox.Consumer {
	t.Helper()
	rd := kafka.NewReader(kafka.ReaderConfig{Brokers: kc.Addrs(), GroupID: group, Topic: topic, MinBytes: 1, MaxBytes: 1 << 20,
		MaxWait: 100 * time.Millisecond, StartOffset: kafka.FirstOffset, CommitInterval: 0})
	c, err := r.p.Inbox().NewConsumer(rd, &inbox.ConsumerConfig{Handlers: r.p.Handlers(), BatchSize: 32,
		RetryInitial: 5 * time.Millisecond, RetryMax: 20 * time.Millisecond, MaxAttempts: 4})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
		require.NoError(t, rd.Close())
	})
	return c
}

// record is c as a relay would publish it to topic, replying to replyTo.
func record(topic, replyTo string, c command) *kgo.Record {
	v, _ := json.Marshal(c.cmd)
	return &kgo.Record{Topic: topic, Partition: 0, Key: []byte(c.key.SagaID.String()), Value: v, Headers: []kgo.RecordHeader{
		{Key: wire.HeaderMessageID, Value: []byte(c.msgID)},
		{Key: wire.HeaderType, Value: []byte(c.typ)},
		{Key: wire.HeaderSagaID, Value: []byte(c.key.SagaID.String())},
		{Key: wire.HeaderStepKey, Value: []byte(c.key.String())},
		{Key: wire.HeaderDirection, Value: []byte(c.key.Direction)},
		{Key: wire.HeaderReplyTo, Value: []byte(replyTo)},
	}}
}

func setHeader(r *kgo.Record, name string, value []byte) {
	for i := range r.Headers {
		if r.Headers[i].Key == name {
			r.Headers[i].Value = value
			return
		}
	}
	r.Headers = append(r.Headers, kgo.RecordHeader{Key: name, Value: value})
}

func produce(t *testing.T, kc *kafkatest.Cluster, recs ...*kgo.Record) []int64 {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(kc.Addrs()...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	require.NoError(t, err)
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	require.NoError(t, cl.ProduceSync(ctx, recs...).FirstErr())
	out := make([]int64, len(recs))
	for i, r := range recs {
		out[i] = r.Offset
	}
	return out
}

// deadLetters maps each dead-lettered offset of consumer to its reasons.
func deadLetters(t *testing.T, d *testkit.DB, consumer string) map[int64][]string {
	t.Helper()
	rows, err := d.Pool.Query(context.Background(), "SELECT kafka_offset, reason FROM "+d.Table("dead_letters")+" WHERE consumer = $1", consumer)
	require.NoError(t, err)
	out := map[int64][]string{}
	var off int64
	var reason string
	_, err = pgx.ForEachRow(rows, []any{&off, &reason}, func() error { out[off] = append(out[off], reason); return nil })
	require.NoError(t, err)
	return out
}

// A consumer with BatchSize 32 over a backlog on one partition: successes,
// refusals, panics, handlers that abuse the transaction, duplicates of one
// step key (same message id and new ones), a compensation before its
// forward, hostile bytes in the payload and in every header, a command
// PostgreSQL refuses the content of, one that fails once with an error that
// is not permanent. Each step's effect and reply exactly as its mode says,
// each poison dead-lettered once at its offset and nothing else, and the
// healthy part of the backlog run several to a transaction.
func TestParticipantConsumerBatchOfEverything(t *testing.T) {
	t.Parallel()
	const topic, replyTo = "r18.svc.commands", "sagaflow.commands.r18.replies"
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, topic, replyTo))
	r := newParticipantRig(t, "svc", replyTo, "")

	// Phase 1: a healthy backlog (no message fails the batch), produced
	// before the consumer starts.
	var healthy []command
	for _, m := range []string{"ok", "refuse", "panic", "sqlrefuse", "nestcommit", "nestrollback", "nestrefuse", "nestsqlok",
		"nestleak", "nestleakref", "endtx", "endtxrefuse", "ok", "panic", "ok"} {
		healthy = append(healthy, newCommand(m))
	}
	early := newCommand("ok")
	var recs []*kgo.Record
	for i, c := range healthy {
		recs = append(recs, record(topic, replyTo, c))
		if i == 3 {
			recs = append(recs, record(topic, replyTo, early.compensation("ok")))
		}
		if i == 6 {
			recs = append(recs, record(topic, replyTo, healthy[0].again()), record(topic, replyTo, healthy[0])) // a copy; the same id again
			recs = append(recs, record(topic, replyTo, early))
		}
	}
	produce(t, kc, recs...)
	cons := r.consume(t, kc, topic, "svc")
	testkit.WaitFor(t, wait, "every healthy command answered", func() bool {
		return len(replies(t, r.db, early.key.String())) >= 1 && len(replies(t, r.db, healthy[len(healthy)-1].key.String())) == 1
	})
	time.Sleep(200 * time.Millisecond)
	var runs1 []int
	for i, c := range healthy {
		m := modes[c.cmd.Mode]
		want := []string{m.reply()}
		if i == 0 {
			want = []string{"ok", "ok"}
		}
		require.Equal(t, want, replyShape(replies(t, r.db, c.key.String())), "command %d (%s)", i, c.cmd.Mode)
		wantMoves := m.moves
		if !m.ok {
			wantMoves = nil
		}
		require.Equal(t, wantMoves, nilIfEmpty(r.moves(t, c.cmd.ID)), "command %d (%s)", i, c.cmd.Mode)
		runs1 = append(runs1, r.runsOf(c.key))
	}
	for i, n := range runs1 {
		require.Equal(t, 1, n, "command %d: no message of the batch failed, its handler ran once", i)
	}
	require.Equal(t, []string{"undo"}, r.moves(t, early.cmd.ID), "the early compensation ran, the forward never")
	require.Equal(t, 0, r.runsOf(early.key))
	require.Equal(t, []string{"refused:compensated_before_run", "refused:compensated_before_run"},
		replyShape(replies(t, r.db, early.key.String())))
	require.Empty(t, deadLetters(t, r.db, "svc"))
	batched := cons.Batched()
	t.Logf("healthy backlog of %d: %d messages batched", len(recs), batched)
	logBatched(t, "commands", batched)
	r.mu.Lock()
	for k, errs := range r.endErrs {
		for _, err := range errs {
			require.Error(t, err, "%s: tx.Commit/tx.Rollback", k)
		}
	}
	r.mu.Unlock()

	// Phase 2: poison and hostile bytes among healthy commands, produced
	// while the consumer runs (a backlog again once the first fails).
	nul, bad, big := "po\x00ison", "po\xff\xfeison", testkit.RandomLetters(10<<10)
	type item struct {
		name string
		rec  *kgo.Record
		cmd  command
		want string // "ok", "refused:<code>", "dead", "either"
	}
	var items []item
	add := func(name, want string, c command, mod func(*kgo.Record)) {
		rec := record(topic, replyTo, c)
		if mod != nil {
			mod(rec)
		}
		items = append(items, item{name, rec, c, want})
	}
	add("ok-first", "ok", newCommand("ok"), nil)
	for _, p := range []struct{ name, s string }{{"nul", nul}, {"utf8", bad}, {"10kB", big}} {
		p := p
		add("msgid-"+p.name, "ok", newCommand("ok"), func(r *kgo.Record) { setHeader(r, wire.HeaderMessageID, []byte(p.s)) })
		add("extra-header-"+p.name, "ok", newCommand("ok"), func(r *kgo.Record) {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: "x-" + p.s, Value: []byte(p.s)})
		})
		add("stepkey-"+p.name, "dead", newCommand("ok"), func(r *kgo.Record) {
			setHeader(r, wire.HeaderStepKey, append(r.Headers[3].Value, p.s...))
		})
		add("replyto-"+p.name, "dead", newCommand("ok"), func(r *kgo.Record) { setHeader(r, wire.HeaderReplyTo, []byte(replyTo+p.s)) })
		add("sagaid-"+p.name, "dead", newCommand("ok"), func(r *kgo.Record) { setHeader(r, wire.HeaderSagaID, []byte(p.s)) })
		add("type-"+p.name, "dead", newCommand("ok"), func(r *kgo.Record) { setHeader(r, wire.HeaderType, []byte(p.s)) })
		add("ok-after-"+p.name, "ok", newCommand("ok"), nil)
	}
	// The payload: a NUL the handler writes to text (PostgreSQL refuses
	// it: dead-lettered at once), 10 kB into an indexed column (past the
	// index limit: the same), invalid UTF-8 inside the JSON string
	// (encoding/json decodes it to U+FFFD: either outcome, not both), a
	// payload that is not JSON (refused: malformed_command).
	nulCmd := newCommand("ok")
	add("payload-nul", "deadrun", nulCmd, func(r *kgo.Record) {
		r.Value = []byte(`{"id":"po\u0000ison-` + nulCmd.key.SagaID.String()[:8] + `","mode":"ok"}`)
	})
	bigCmd := newCommand("ok")
	add("payload-10kB", "deadrun", bigCmd, func(r *kgo.Record) { r.Value = []byte(`{"id":"` + big + `","mode":"ok"}`) })
	utfCmd := newCommand("ok")
	add("payload-utf8", "either", utfCmd, func(r *kgo.Record) {
		r.Value = []byte(`{"id":"` + utfCmd.cmd.ID + bad + `","mode":"ok"}`)
	})
	add("payload-not-json", "refused:"+participant.CodeMalformedCommand, newCommand("ok"), func(r *kgo.Record) {
		r.Value = []byte("\x00\xff not json " + nul)
	})
	add("flaky", "ok", newCommand("flaky"), nil)
	add("panic", "refused:panic", newCommand("panic"), nil)
	add("endtx", "ok", newCommand("endtx"), nil)
	add("ok-last", "ok", newCommand("ok"), nil)
	recs = recs[:0]
	for _, it := range items {
		recs = append(recs, it.rec)
	}
	offsets := produce(t, kc, recs...)
	last := items[len(items)-1].cmd
	testkit.WaitFor(t, wait, "the last command answered", func() bool { return len(replies(t, r.db, last.key.String())) == 1 })
	time.Sleep(300 * time.Millisecond) // nothing more may come

	dl := deadLetters(t, r.db, "svc")
	for i, it := range items {
		rs := replyShape(replies(t, r.db, it.cmd.key.String()))
		mv := r.movesOfKey(t, it.cmd.key.String())
		switch it.want {
		case "dead", "deadrun":
			require.Len(t, dl[offsets[i]], 1, "%s: dead-lettered once", it.name)
			require.Empty(t, rs, "%s: no reply", it.name)
			require.Empty(t, mv, "%s: no effect", it.name)
			if it.want == "dead" {
				require.Equal(t, 0, r.runsOf(it.cmd.key), "%s: its handler never ran", it.name)
			}
		case "either":
			var n int
			require.NoError(t, r.db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+r.db.Table("moves")+
				" WHERE step_key = $1", it.cmd.key.String()).Scan(&n))
			t.Logf("%s: replies %v, moves %d, dead letters %v", it.name, rs, n, dl[offsets[i]])
			if len(dl[offsets[i]]) > 0 {
				require.Len(t, dl[offsets[i]], 1, it.name)
				require.Empty(t, rs, it.name)
				require.Zero(t, n, it.name)
			} else {
				require.Equal(t, []string{"ok"}, rs, it.name)
				require.Equal(t, 1, n, it.name)
			}
		default:
			require.Empty(t, dl[offsets[i]], "%s: not dead-lettered (%v)", it.name, dl[offsets[i]])
			require.Equal(t, []string{it.want}, rs, "%s: one reply", it.name)
			if it.want == "ok" && !strings.HasPrefix(it.name, "payload") {
				want := modes[it.cmd.cmd.Mode].moves
				if it.cmd.cmd.Mode == "flaky" {
					want = []string{"do"}
				}
				require.Equal(t, want, r.moves(t, it.cmd.cmd.ID), "%s: its effect once", it.name)
			}
		}
	}
	for off, reasons := range dl {
		found := false
		for i, it := range items {
			if offsets[i] == off && (it.want == "dead" || it.want == "deadrun" || it.want == "either") {
				found = true
			}
		}
		require.True(t, found, "offset %d dead-lettered and should not be: %v", off, reasons)
	}
}

// Two tenants: two participants, each on a schema of its own, with the same
// consumer name and the same command types, on one broker, each reading its
// own topic in its own group and replying only to its own reply topic. The
// same step keys go to both (one saga id, two services); commands naming
// the other tenant's reply topic go to each. Each runs its own commands
// once, replies only to its own topic, and dead-letters the crossed ones.
func TestParticipantTwoTenantsOneBroker(t *testing.T) {
	t.Parallel()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "ta.commands", "tb.commands", "ta.replies", "tb.replies"))
	ta := newParticipantRig(t, "payments", "ta.replies", "ta")
	tb := newParticipantRig(t, "payments", "tb.replies", "tb")
	var shared []command
	for _, m := range []string{"ok", "refuse", "panic", "endtx", "nestcommit", "ok"} {
		shared = append(shared, newCommand(m))
	}
	forTenant := func(tenant string, c command) command {
		c.cmd.ID = tenant + "-" + c.cmd.ID
		return c
	}
	var recA, recB []*kgo.Record
	for _, c := range shared {
		recA = append(recA, record("ta.commands", "ta.replies", forTenant("ta", c)))
		recB = append(recB, record("tb.commands", "tb.replies", forTenant("tb", c)))
	}
	produce(t, kc, recA...)
	produce(t, kc, recB...)
	ca := ta.consume(t, kc, "ta.commands", "ta-payments")
	cb := tb.consume(t, kc, "tb.commands", "tb-payments")
	last := shared[len(shared)-1].key.String()
	testkit.WaitFor(t, wait, "both tenants answered", func() bool {
		return len(replies(t, ta.db, last)) == 1 && len(replies(t, tb.db, last)) == 1
	})
	batchedA, batchedB := ca.Batched(), cb.Batched()
	logBatched(t, "ta's commands", batchedA)
	logBatched(t, "tb's commands", batchedB)
	// Then the crossed commands, each followed by a copy of the first.
	crossA := forTenant("ta", newCommand("ok")) // names tb's reply topic
	crossB := forTenant("tb", newCommand("ok"))
	offA := produce(t, kc, record("ta.commands", "tb.replies", crossA), record("ta.commands", "ta.replies", forTenant("ta", shared[0]).again()))
	offB := produce(t, kc, record("tb.commands", "ta.replies", crossB), record("tb.commands", "tb.replies", forTenant("tb", shared[0]).again()))
	testkit.WaitFor(t, wait, "both tenants answered the copies", func() bool {
		return len(replies(t, ta.db, shared[0].key.String())) == 2 && len(replies(t, tb.db, shared[0].key.String())) == 2
	})
	time.Sleep(200 * time.Millisecond)
	for _, x := range []struct {
		name string
		r    *participantRig
		off  []int64
	}{{"ta", ta, offA}, {"tb", tb, offB}} {
		for i, c := range shared {
			c = forTenant(x.name, c)
			m := modes[c.cmd.Mode]
			want := []string{m.reply()}
			if i == 0 {
				want = []string{"ok", "ok"}
			}
			rs := replies(t, x.r.db, c.key.String())
			require.Equal(t, want, replyShape(rs), "%s: command %d", x.name, i)
			for _, rr := range rs {
				require.Equal(t, x.name+".replies", rr.topic, "%s replies only to its own topic", x.name)
			}
			wantMoves := m.moves
			if !m.ok {
				wantMoves = nil
			}
			require.Equal(t, wantMoves, nilIfEmpty(x.r.moves(t, c.cmd.ID)), "%s: command %d", x.name, i)
			require.Equal(t, 1, x.r.runsOf(c.key), "%s: command %d ran once", x.name, i)
		}
		dl := deadLetters(t, x.r.db, "payments")
		require.Len(t, dl, 1, "%s: only the crossed command is dead-lettered: %v", x.name, dl)
		require.Len(t, dl[x.off[0]], 1, x.name)
		require.Contains(t, dl[x.off[0]][0], participant.CodeReplyTopicRefused, x.name)
		x.r.mu.Lock()
		require.Empty(t, x.r.sawOther, "%s ran no command of the other tenant", x.name)
		x.r.mu.Unlock()
		var n int
		require.NoError(t, x.r.db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+x.r.db.Table("outbox")+
			" WHERE topic <> $1", x.name+".replies").Scan(&n))
		require.Zero(t, n, "%s wrote nothing for another topic", x.name)
	}
	require.Empty(t, replies(t, ta.db, crossA.key.String()))
	require.Empty(t, replies(t, tb.db, crossB.key.String()))
	t.Logf("batched: ta %d, tb %d", batchedA, batchedB)
}

// movesOfKey lists the moves recorded under step key key.
func (r *participantRig) movesOfKey(t *testing.T, key string) []string {
	t.Helper()
	rows, err := r.db.Pool.Query(context.Background(), "SELECT move FROM "+r.db.Table("moves")+" WHERE step_key = $1 ORDER BY ctid", key)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}
