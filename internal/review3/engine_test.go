package review3_test

import (
	"context"
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/wire"
)

const (
	svcTopic      = "svc.commands"
	rvReplies     = "sagaflow.commands.rv.replies"
	rvCommandTopc = "sagaflow.commands.rv"
)

type charge struct {
	Order    string `json:"order"`
	ChargeID string `json:"charge_id,omitempty"`
}

// remoteEngine starts, on a fresh schema, a relay and a Kafka-mode engine
// running saga rv, whose one step is remote: no participant serves it, the
// test answers by hand. onReply counts the replies the saga applied.
func remoteEngine(t *testing.T, kc *kafkatest.Cluster, pool *pgxpool.Pool, schema string, key []byte, onReply *atomic.Int64) (*saga.Engine, *saga.Definition[charge]) {
	t.Helper()
	ctx := context.Background()
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	r, err := relay.New(pool, w, &relay.Config{Schema: schema})
	require.NoError(t, err)
	require.NoError(t, r.Start(ctx))
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = r.Stop(sctx)
		_ = w.Close()
	})
	def := saga.Define("rv", saga.Step[charge]{Name: "charge", Timeout: time.Minute, Remote: &saga.Remote[charge]{
		Topic: svcTopic, Type: "svc.do",
		Command: func(_ context.Context, _ *saga.StepRun, c *charge) (any, error) { return c, nil },
		OnReply: func(_ context.Context, _ *saga.StepRun, c *charge, result json.RawMessage) error {
			onReply.Add(1)
			var res struct {
				ChargeID string `json:"charge_id"`
			}
			if err := json.Unmarshal(result, &res); err != nil {
				return err
			}
			c.ChargeID = res.ChargeID
			return nil
		},
	}})
	e, err := saga.New(pool, &saga.Config{Schema: schema, PollInterval: 20 * time.Millisecond,
		Kafka: &saga.KafkaConfig{Brokers: kc.Addrs(), SigningKey: key, AllSteps: true}})
	require.NoError(t, err)
	require.NoError(t, e.Register(def))
	require.NoError(t, e.Start(ctx))
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = e.Stop(sctx)
	})
	return e, def
}

// startAndAwaitCommand starts a saga and returns its id and the remote
// command the engine sent for it.
func startAndAwaitCommand(t *testing.T, e *saga.Engine, def *saga.Definition[charge], cmds *collector, order string) (string, string) {
	t.Helper()
	st, err := saga.Start(context.Background(), e, def, charge{Order: order}, nil)
	require.NoError(t, err)
	id := st.ID.String()
	eventually(t, 15*time.Second, func() bool { return len(cmds.with(wire.HeaderSagaID, id)) > 0 }, "the remote command of saga "+id)
	c := cmds.with(wire.HeaderSagaID, id)[0]
	key, _ := header(c, wire.HeaderStepKey)
	return id, key
}

func reply(id, key string, extra ...hdr) []hdr {
	hs := []hdr{{wire.HeaderMessageID, newID()}, {wire.HeaderType, wire.TypeReply}, {wire.HeaderSagaID, id}, {wire.HeaderStepKey, key}}
	return append(hs, extra...)
}

func deadLetters(t *testing.T, e *saga.Engine) []saga.DeadLetter {
	t.Helper()
	page, err := e.DeadLetters(context.Background(), &saga.DeadOpts{Limit: 500})
	require.NoError(t, err)
	return page.Letters
}

func status(t *testing.T, e *saga.Engine, id string) *saga.Instance {
	t.Helper()
	in, err := e.Get(context.Background(), uuid.MustParse(id))
	require.NoError(t, err)
	return in
}

// The engine's side of a remote step, answered by hand: the remote command
// carries what the doc lists; bad replies are dead-lettered or dropped, never
// holding back the good reply behind them; a reply with an unknown field
// completes the step, and duplicates of it have no effect.
func TestEngineHandBuiltReplies(t *testing.T) {
	pool, schema := migrated(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, svcTopic, rvReplies, rvCommandTopc))
	var applied atomic.Int64
	e, def := remoteEngine(t, kc, pool, schema, nil, &applied)
	cmds := collect(t, kc, svcTopic)
	prod := producer(t, kc)

	id, key := startAndAwaitCommand(t, e, def, cmds, "o-1")
	c := cmds.with(wire.HeaderSagaID, id)[0]
	require.Equal(t, id, string(c.Key), "Kafka key: the saga id")
	require.Equal(t, id+"/charge/forward/0", key, "the step key's canonical form")
	mid, _ := header(c, wire.HeaderMessageID)
	u, err := uuid.Parse(mid)
	require.NoError(t, err)
	require.Equal(t, uuid.Version(7), u.Version(), "a new UUIDv7")
	require.Equal(t, strings.ToLower(mid), mid)
	for name, want := range map[string]string{wire.HeaderType: "svc.do", wire.HeaderDirection: "forward", wire.HeaderReplyTo: rvReplies} {
		got, n := header(c, name)
		require.Equal(t, 1, n, name)
		require.Equal(t, want, got, name)
	}
	require.JSONEq(t, `{"order":"o-1"}`, string(c.Value))

	good := []byte(`{"ok":true,"result":{"charge_id":"ch_3Pq"},"added_in_v2":{"x":1}}`)
	big := strings.Repeat("v", 10240)
	other := newID()
	// dead: the doc says these are dead-lettered; stale: dropped.
	dead := map[string]func() ([]hdr, []byte){
		"forged saga id":          func() ([]hdr, []byte) { return reply(other, key), good },
		"missing step key":        func() ([]hdr, []byte) { return drop(reply(id, key), wire.HeaderStepKey), good },
		"key does not parse":      func() ([]hdr, []byte) { return reply(id, id+"/charge/forward"), good },
		"repeated type header":    func() ([]hdr, []byte) { return reply(id, key, hdr{wire.HeaderType, wire.TypeReply}), good },
		"repeated step key":       func() ([]hdr, []byte) { return reply(id, key, hdr{wire.HeaderStepKey, key}), good },
		"unknown saga":            func() ([]hdr, []byte) { return reply(other, other+"/charge/forward/0"), good },
		"NUL in saga id header":   func() ([]hdr, []byte) { return reply(id+"\x00", key), good },
		"10 kB saga id header":    func() ([]hdr, []byte) { return reply(big, key), good },
		"invalid UTF-8 saga id h": func() ([]hdr, []byte) { return reply(id+"\xff", key), good },
	}
	stale := map[string]func() ([]hdr, []byte){
		"stale epoch":      func() ([]hdr, []byte) { return reply(id, id+"/charge/forward/1"), good },
		"wrong direction":  func() ([]hdr, []byte) { return reply(id, id+"/charge/compensate/0"), good },
		"other step":       func() ([]hdr, []byte) { return reply(id, id+"/ship/forward/0"), good },
		"upper-case saga":  func() ([]hdr, []byte) { return reply(id, strings.ToUpper(id)+"/charge/forward/1"), good },
		"no saga id, late": func() ([]hdr, []byte) { return drop(reply(id, id+"/charge/forward/2"), wire.HeaderSagaID), good },
	}
	// Header values with NUL, invalid UTF-8 and 10 kB in the headers the
	// doc does not check: nothing may panic or stall; where they go is
	// recorded below.
	odd := map[string]func() ([]hdr, []byte){
		"NUL message id": func() ([]hdr, []byte) {
			return set(reply(id, id+"/charge/forward/3"), wire.HeaderMessageID, "m\x00"), good
		},
		"10 kB message id": func() ([]hdr, []byte) { return set(reply(id, id+"/charge/forward/3"), wire.HeaderMessageID, big), good },
		"invalid UTF-8 message id": func() ([]hdr, []byte) {
			return set(reply(id, id+"/charge/forward/3"), wire.HeaderMessageID, "m\xff"), good
		},
		"10 kB type": func() ([]hdr, []byte) { return set(reply(id, key), wire.HeaderType, big), good },
		"NUL type":   func() ([]hdr, []byte) { return set(reply(id, key), wire.HeaderType, "sagaflow.reply\x00"), good },
		"10 kB unknown header": func() ([]hdr, []byte) {
			return reply(id, id+"/charge/forward/3", hdr{"sagaflow-x", big}, hdr{"traceparent", "\x00\xff"}), good
		},
		"10 kB value": func() ([]hdr, []byte) {
			return reply(id, id+"/charge/forward/3"), []byte(`{"ok":true,"result":"` + big + `"}`)
		},
	}
	for _, set := range []map[string]func() ([]hdr, []byte){dead, stale, odd} {
		for _, build := range set {
			hs, v := build()
			send(t, prod, rvReplies, id, hs, v)
		}
	}
	require.Equal(t, saga.Status("running"), status(t, e, id).Status, "no bad reply completed the step")

	// The reply built per the doc, with a field the doc does not know.
	send(t, prod, rvReplies, id, reply(id, key), good)
	in := sagatest.WaitEnded(t, e, uuid.MustParse(id), nil)
	require.Equal(t, saga.Status("completed"), in.Status, sagatest.Describe(in))
	var st charge
	require.NoError(t, in.DecodeState(&st))
	require.Equal(t, "ch_3Pq", st.ChargeID)

	// The same reply twice more: same id, and another id.
	hs := reply(id, key)
	send(t, prod, rvReplies, id, hs, good)
	send(t, prod, rvReplies, id, hs, good)
	send(t, prod, rvReplies, id, reply(id, key), []byte(`{"ok":false,"code":"late"}`))
	// A marker behind them: a second saga's reply, which must complete it.
	id2, key2 := startAndAwaitCommand(t, e, def, cmds, "o-2")
	send(t, prod, rvReplies, id2, reply(id2, key2), good)
	sagatest.WaitEnded(t, e, uuid.MustParse(id2), nil)
	require.EqualValues(t, 2, applied.Load(), "one applied reply per saga")
	in = status(t, e, id)
	require.Equal(t, saga.Status("completed"), in.Status)
	require.Nil(t, in.LastError)

	letters := deadLetters(t, e)
	var reasons []string
	for _, l := range letters {
		reasons = append(reasons, l.Reason)
	}
	t.Logf("%d dead letters:\n%s", len(letters), strings.Join(reasons, "\n"))
	require.GreaterOrEqual(t, len(letters), len(dead), "each malformed reply dead-lettered")
	require.LessOrEqual(t, len(letters), len(dead)+len(odd), "stale replies and duplicates are dropped, not dead-lettered")
	var unknown int
	for _, r := range reasons {
		if strings.HasPrefix(r, "unknown_saga") {
			unknown++
		}
	}
	require.Equal(t, 1, unknown, "the reply for a saga that does not exist: unknown_saga")
}

// protocol.md gives a step name as "1 to 64 of a-z A-Z 0-9 . - _", and says
// "Bad input never stops a partition and is never lost: it is stored with its
// reason". The participant dead-letters a command whose step key holds a NUL,
// invalid UTF-8 or is over 512 bytes (not_a_saga_command). The engine should
// not silently drop a reply with such a key either.
func TestEngineReplyWithUnstorableStepKey(t *testing.T) {
	pool, schema := migrated(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, svcTopic, rvReplies, rvCommandTopc))
	var applied atomic.Int64
	e, def := remoteEngine(t, kc, pool, schema, nil, &applied)
	cmds := collect(t, kc, svcTopic)
	prod := producer(t, kc)
	id, key := startAndAwaitCommand(t, e, def, cmds, "o-1")
	good := []byte(`{"ok":true,"result":{"charge_id":"ch_1"}}`)
	bad := map[string]string{
		"NUL":           id + "/ch\x00arge/forward/0",
		"invalid UTF-8": id + "/ch\xffarge/forward/0",
		"10 kB":         id + "/" + strings.Repeat("s", 10240) + "/forward/0",
	}
	for _, k := range bad {
		send(t, prod, rvReplies, id, reply(id, k), good)
	}
	send(t, prod, rvReplies, id, reply(id, key), good)
	in := sagatest.WaitEnded(t, e, uuid.MustParse(id), nil)
	require.Equal(t, saga.Status("completed"), in.Status, "the bad replies did not hold back the good one")
	// Was a finding: they were dropped as stale, without a trace.
	require.Len(t, deadLetters(t, e), len(bad), "each reply with an unstorable step name is dead-lettered")
}

// The doc: ParseKey accepts the saga id in upper case, and "a participant
// should send back the key it received". A participant that upper-cases the
// key it echoes: does the engine take the reply?
func TestEngineReplyWithUpperCaseKey(t *testing.T) {
	pool, schema := migrated(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, svcTopic, rvReplies, rvCommandTopc))
	var applied atomic.Int64
	e, def := remoteEngine(t, kc, pool, schema, nil, &applied)
	cmds := collect(t, kc, svcTopic)
	prod := producer(t, kc)
	id, key := startAndAwaitCommand(t, e, def, cmds, "o-1")
	upper := strings.ToUpper(id) + strings.TrimPrefix(key, id)
	send(t, prod, rvReplies, id, reply(strings.ToUpper(id), upper), []byte(`{"ok":true,"result":{"charge_id":"ch_1"}}`))
	in := sagatest.WaitEnded(t, e, uuid.MustParse(id), &sagatest.WaitOpts{Timeout: 5 * time.Second})
	require.Equal(t, saga.Status("completed"), in.Status)
	require.EqualValues(t, 1, applied.Load())
}
