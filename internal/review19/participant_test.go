package review19_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

type pcmd struct {
	ID string `json:"id"`
}

// prig is a participant on a schema of its own with handlers "r19.do" and
// "r19.undo", which write (id, kind, step key) to "moves"; undo refuses
// while refuseUndo says so.
type prig struct {
	db      *testkit.DB
	p       *participant.Participant
	replyTo string

	mu         sync.Mutex
	runs       map[string]int
	seen       map[string]string // step key -> the id the handler saw
	refuseUndo map[string]bool   // step key -> refuse
}

func newPrig(t *testing.T, consumer string) *prig {
	t.Helper()
	r := &prig{db: testkit.NewDB(t), replyTo: "sagaflow.commands.r19p.replies", runs: map[string]int{}, seen: map[string]string{}, refuseUndo: map[string]bool{}}
	_, err := r.db.Pool.Exec(context.Background(), "CREATE TABLE "+r.db.Table("moves")+" (id text, kind text, step_key text)")
	require.NoError(t, err)
	r.p, err = participant.New(r.db.Pool, &participant.Config{Consumer: consumer, Schema: r.db.Schema, Logger: testkit.Discard,
		ReplyTopics: []string{r.replyTo}})
	require.NoError(t, err)
	for _, kind := range []string{"do", "undo"} {
		require.NoError(t, participant.Handle(r.p, "r19."+kind, func(ctx context.Context, tx pgx.Tx, c participant.Call[pcmd]) (map[string]string, error) {
			r.mu.Lock()
			r.runs[c.Key.String()]++
			r.seen[c.Key.String()] = c.Command.ID
			refuse := kind == "undo" && r.refuseUndo[c.Key.String()]
			r.mu.Unlock()
			if refuse {
				return nil, steps.Permanent(steps.WithCode("not_now", errors.New("review19: the refund desk is closed")))
			}
			_, err := tx.Exec(ctx, "INSERT INTO "+r.db.Table("moves")+" VALUES ($1, $2, $3)", c.Command.ID, kind, c.Key.String())
			return map[string]string{"ref": kind}, err
		}))
	}
	return r
}

func (r *prig) runsOf(k steps.Key) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.runs[k.String()]
}

// headers of a command for key with message id msgID.
func (r *prig) headers(k steps.Key, msgID string) map[string]string {
	typ := "r19.do"
	if k.Direction == steps.Compensate {
		typ = "r19.undo"
	}
	return map[string]string{wire.HeaderMessageID: msgID, wire.HeaderType: typ, wire.HeaderSagaID: k.SagaID.String(),
		wire.HeaderStepKey: k.String(), wire.HeaderDirection: string(k.Direction), wire.HeaderReplyTo: r.replyTo}
}

// process delivers the command for k with payload v under a new message
// id, alone, as inbox.Inbox.Process does.
func (r *prig) process(t *testing.T, k steps.Key, v string) {
	t.Helper()
	id := uuid.NewString()
	h := r.headers(k, id)
	_, err := r.p.Inbox().Process(context.Background(), inbox.Message{ID: id, Type: h[wire.HeaderType], Key: []byte(k.SagaID.String()),
		Value: []byte(v), Headers: h}, r.p.Handlers()[h[wire.HeaderType]])
	require.NoError(t, err)
}

// replies are the participant's replies for key k, oldest first, as "ok"
// or "refused:<code>".
func (r *prig) replies(t *testing.T, k steps.Key) []string {
	t.Helper()
	rows, err := r.db.Pool.Query(context.Background(), "SELECT payload FROM "+r.db.Table("outbox")+
		" WHERE step_key = $1 AND type = $2 ORDER BY created_at, ctid", k.String(), steps.ReplyType)
	require.NoError(t, err)
	var out []string
	var payload []byte
	_, err = pgx.ForEachRow(rows, []any{&payload}, func() error {
		var rp steps.Reply
		if err := json.Unmarshal(payload, &rp); err != nil {
			return err
		}
		if rp.OK {
			out = append(out, "ok")
		} else {
			out = append(out, "refused:"+rp.Code)
		}
		return nil
	})
	require.NoError(t, err)
	return out
}

func (r *prig) moves(t *testing.T, k steps.Key) []string {
	t.Helper()
	rows, err := r.db.Pool.Query(context.Background(), "SELECT kind FROM "+r.db.Table("moves")+" WHERE step_key IN ($1, $2) ORDER BY ctid",
		k.String(), steps.Key{SagaID: k.SagaID, Step: k.Step, Direction: steps.Compensate, Epoch: k.Epoch}.String())
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}

// participant/doc.go: "A compensation that arrives before its forward
// step's command ... closes the step: the forward is refused with
// CodeCompensatedBeforeRun and never runs. Only a compensation that is
// carried out closes it: one the handler refuses leaves the step open, so
// the forward may still run, and the compensation, sent again by the saga,
// then undoes it." Refused first: the forward runs, and the compensation
// sent again (same step key, new message id) runs and undoes it. Carried
// out first (the control): the forward is refused and never runs.
func TestParticipantRefusedCompensationLeavesTheStepOpen(t *testing.T) {
	t.Parallel()
	r := newPrig(t, "r19-svc")
	fwd := steps.Key{SagaID: uuid.New(), Step: "pay", Direction: steps.Forward}
	comp := fwd
	comp.Direction = steps.Compensate
	r.mu.Lock()
	r.refuseUndo[comp.String()] = true
	r.mu.Unlock()
	r.process(t, comp, `{"id":"refused-first"}`)
	r.mu.Lock()
	r.refuseUndo[comp.String()] = false
	r.mu.Unlock()
	r.process(t, fwd, `{"id":"refused-first"}`)
	r.process(t, comp, `{"id":"refused-first"}`)
	require.Equal(t, 1, r.runsOf(fwd), "the forward ran")
	require.Equal(t, 2, r.runsOf(comp), "the compensation sent again ran again")
	require.Equal(t, []string{"do", "undo"}, r.moves(t, fwd))
	require.Equal(t, []string{"ok"}, r.replies(t, fwd))
	require.Equal(t, []string{"refused:not_now", "ok"}, r.replies(t, comp))

	// The control: a compensation carried out first closes the step.
	fwd2 := steps.Key{SagaID: uuid.New(), Step: "pay", Direction: steps.Forward}
	comp2 := fwd2
	comp2.Direction = steps.Compensate
	r.process(t, comp2, `{"id":"undone-first"}`)
	before := r.replies(t, fwd2)
	r.process(t, fwd2, `{"id":"undone-first"}`)
	require.Zero(t, r.runsOf(fwd2))
	rs := r.replies(t, fwd2)
	require.NotEmpty(t, rs)
	for _, x := range rs {
		require.Equal(t, "refused:"+participant.CodeCompensatedBeforeRun, x, "the forward's replies %v", rs)
	}
	t.Logf("the forward's replies after the carried-out compensation alone: %v; after the forward too: %v (O3)", before, rs)
	require.Equal(t, []string{"undo"}, r.moves(t, fwd2))
}

// A participant's consumer with BatchSize 8 ("If any message of the batch
// is poison or its handler fails, nothing of the batch is committed and its
// messages run one at a time, each handler once more") over a backlog of
// commands: healthy ones, one whose JSON string holds invalid UTF-8 (doc:
// "becomes U+FFFD ... and the command runs"), one whose JSON escapes a NUL
// that the handler writes to a text column (doc: "an error of PostgreSQL
// refusing a value, a NUL byte in text say ... the command is dead-lettered
// at once"), one that is not JSON (refused, CodeMalformedCommand), one
// with a message id of 10 kB of NULs (inbox.Message: recorded as its
// SHA-256, "so any id deduplicates"), one whose reply-to holds a NUL
// (CodeReplyTopicRefused, dead-lettered, no reply), one whose step key is
// invalid UTF-8 (CodeNotASagaCommand), and an exact copy of the first.
func TestParticipantConsumerHostileBytesInOneBatch(t *testing.T) {
	t.Parallel()
	const topic = "r19p.commands"
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, topic, "sagaflow.commands.r19p.replies"))
	r := newPrig(t, "r19p-svc")
	type c struct {
		what    string
		key     steps.Key
		value   string
		msgID   string
		mutate  func(h map[string]string)
		replies []string // expected
		dead    bool
		runs    int // expected handler runs at least (a rerun adds one)
	}
	nk := func() steps.Key { return steps.Key{SagaID: uuid.New(), Step: "pay", Direction: steps.Forward} }
	cs := []*c{
		{what: "healthy 0", key: nk(), value: `{"id":"h0"}`, replies: []string{"ok"}, runs: 1},
		{what: "invalid UTF-8 in a JSON string", key: nk(), value: "{\"id\":\"u-\xff\xfe\"}", replies: []string{"ok"}, runs: 1},
		{what: "an escaped NUL written to text", key: nk(), value: `{"id":"n-\u0000-n"}`, dead: true, runs: 1},
		{what: "not JSON", key: nk(), value: "\xff\x00{", replies: []string{"refused:" + participant.CodeMalformedCommand}},
		{what: "a message id of 10 kB of NULs", key: nk(), value: `{"id":"bigid"}`, msgID: string(make([]byte, 10000)), replies: []string{"ok"}, runs: 1},
		{what: "a reply-to with a NUL", key: nk(), value: `{"id":"rt"}`, dead: true,
			mutate: func(h map[string]string) { h[wire.HeaderReplyTo] = "sagaflow.commands.r19p.replies\x00" }},
		{what: "a step key of invalid UTF-8", key: nk(), value: `{"id":"sk"}`, dead: true,
			mutate: func(h map[string]string) { h[wire.HeaderStepKey] = "\xff\xfe" + h[wire.HeaderStepKey] }},
		{what: "healthy 7", key: nk(), value: `{"id":"h7"}`, replies: []string{"ok"}, runs: 1},
	}
	var recs []*kgo.Record
	for _, x := range cs {
		if x.msgID == "" {
			x.msgID = uuid.NewString()
		}
		h := r.headers(x.key, x.msgID)
		if x.mutate != nil {
			x.mutate(h)
		}
		rr := &kgo.Record{Topic: topic, Key: []byte(x.key.SagaID.String()), Value: []byte(x.value)}
		for _, name := range []string{wire.HeaderMessageID, wire.HeaderType, wire.HeaderSagaID, wire.HeaderStepKey, wire.HeaderDirection, wire.HeaderReplyTo} {
			rr.Headers = append(rr.Headers, kgo.RecordHeader{Key: name, Value: []byte(h[name])})
		}
		recs = append(recs, rr)
	}
	dup := *recs[0]
	recs = append(recs, &dup)
	offsets := produce(t, kc, recs...)
	testkit.Serve(t, kc.Addrs(), r.p, topic, "r19p-svc", inbox.ConsumerConfig{BatchSize: 8, MaxAttempts: 3,
		RetryInitial: 20 * time.Millisecond, RetryMax: 100 * time.Millisecond})

	deadAt := func() map[int64][]string {
		rows, err := r.db.Pool.Query(context.Background(), "SELECT kafka_offset, reason FROM "+r.db.Table("dead_letters")+" WHERE consumer = $1", "r19p-svc")
		require.NoError(t, err)
		out := map[int64][]string{}
		var off int64
		var reason string
		_, err = pgx.ForEachRow(rows, []any{&off, &reason}, func() error { out[off] = append(out[off], reason); return nil })
		require.NoError(t, err)
		return out
	}
	testkit.WaitFor(t, wait, "every command answered or dead-lettered", func() bool {
		dead := deadAt()
		for i, x := range cs {
			if x.dead && len(dead[offsets[i]]) == 0 {
				return false
			}
			if !x.dead && len(r.replies(t, x.key)) < len(x.replies) {
				return false
			}
		}
		return true
	})
	time.Sleep(500 * time.Millisecond) // the copy, and anything sent twice
	dead := deadAt()
	for i, x := range cs {
		t.Logf("%q: runs %d, replies %v, dead %v", x.what, r.runsOf(x.key), r.replies(t, x.key), shortAll(dead[offsets[i]]))
	}
	for i, x := range cs {
		require.Equal(t, x.replies, r.replies(t, x.key), "%q: replies", x.what)
		if x.dead {
			require.Len(t, dead[offsets[i]], 1, "%q: dead-lettered once", x.what)
		} else {
			require.Empty(t, dead[offsets[i]], "%q: dead-lettered", x.what)
		}
		require.GreaterOrEqual(t, r.runsOf(x.key), x.runs, "%q: handler runs", x.what)
		if x.runs == 0 {
			require.Zero(t, r.runsOf(x.key), "%q: the handler ran", x.what)
		}
		want := 0
		if len(x.replies) == 1 && x.replies[0] == "ok" {
			want = 1
		}
		require.Len(t, r.moves(t, x.key), want, "%q: moves kept", x.what)
	}
	require.Empty(t, dead[offsets[len(offsets)-1]], "the exact copy is a duplicate, not dead")
	r.mu.Lock()
	saw := r.seen[cs[1].key.String()]
	r.mu.Unlock()
	require.Equal(t, "u-\uFFFD\uFFFD", saw, "the handler saw U+FFFD where the invalid bytes were")
}
