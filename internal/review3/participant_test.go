package review3_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/wire"
)

const (
	payTopic   = "pay.commands"
	replyTopic = "sagaflow.commands.p.replies"
)

var signingKey = []byte("review3 shared signing key")

// command builds a remote command's headers as docs/protocol.md "Remote
// commands" lists them, signed by hand.
func command(typ, sagaID, key string, dir wire.Direction, value []byte) []hdr {
	hs := []hdr{
		{wire.HeaderMessageID, newID()},
		{wire.HeaderType, typ},
		{wire.HeaderSagaID, sagaID},
		{wire.HeaderStepKey, key},
		{wire.HeaderDirection, string(dir)},
		{wire.HeaderReplyTo, replyTopic},
	}
	return append(hs, hdr{wire.HeaderSignature, signHand(signingKey, hs, value)})
}

// resign replaces hs's signature with one computed over hs as they are now.
func resign(hs []hdr, value []byte) []hdr {
	var out []hdr
	for _, h := range hs {
		if h.k != wire.HeaderSignature {
			out = append(out, h)
		}
	}
	return append(out, hdr{wire.HeaderSignature, signHand(signingKey, out, value)})
}

func set(hs []hdr, name, v string) []hdr {
	out := append([]hdr(nil), hs...)
	for i := range out {
		if out[i].k == name {
			out[i].v = v
		}
	}
	return out
}

func drop(hs []hdr, name string) []hdr {
	var out []hdr
	for _, h := range hs {
		if h.k != name {
			out = append(out, h)
		}
	}
	return out
}

// A participant in the real runtime, fed hand-built signed commands over
// Kafka: the doc's command is served and its reply is signed as the doc says;
// duplicates have one effect; bad commands get no reply and are
// dead-lettered, and none of them holds back the good command behind it.
func TestParticipantHandBuiltCommands(t *testing.T) {
	pool, schema := migrated(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, payTopic, replyTopic))
	var effects atomic.Int64
	sagatest.NewParticipant(t, sagatest.ParticipantConfig{
		Brokers: kc.Addrs(), Topic: payTopic, Pool: pool, Schema: schema, SigningKey: signingKey,
		Answers: map[string]sagatest.Answer{
			"pay.charge": sagatest.AnswerFunc(func(context.Context, sagatest.Call) (any, error) {
				return map[string]int64{"n": effects.Add(1)}, nil
			}),
			"pay.refund": sagatest.Reply(map[string]string{"refunded": "yes"}),
		},
	})
	prod := producer(t, kc)
	replies := collect(t, kc, replyTopic)
	value := []byte(`{"order_id":"o-42","amount_cents":4000,"currency":"EUR"}`)
	waitReplies := func(key string, n int) {
		t.Helper()
		eventually(t, 15*time.Second, func() bool { return len(replies.with(wire.HeaderStepKey, key)) >= n }, fmt.Sprintf("%d replies for %s", n, key))
	}

	// 1. A command built exactly per the doc.
	sagaA := newID()
	keyA := sagaA + "/charge/forward/0"
	cmdA := command("pay.charge", sagaA, keyA, wire.Forward, value)
	send(t, prod, payTopic, sagaA, cmdA, value)
	waitReplies(keyA, 1)
	r := replies.with(wire.HeaderStepKey, keyA)[0]
	typ, _ := header(r, wire.HeaderType)
	require.Equal(t, wire.TypeReply, typ)
	sid, _ := header(r, wire.HeaderSagaID)
	require.Equal(t, sagaA, sid)
	require.Equal(t, sagaA, string(r.Key), "Kafka key: the saga id")
	rep, err := wire.DecodeReply(r.Value)
	require.NoError(t, err)
	require.True(t, rep.OK, "reply %s", r.Value)
	sig, _ := header(r, wire.HeaderSignature)
	var rh []hdr
	for _, h := range r.Headers {
		rh = append(rh, hdr{h.Key, string(h.Value)})
	}
	require.Equal(t, signHand(signingKey, rh, r.Value), sig, "the reply's signature, computed by hand per the doc (reply signs 0: for direction and reply-to)")

	// 2. The same message again (same id): no second effect, no second reply.
	send(t, prod, payTopic, sagaA, cmdA, value)
	// 3. The same step key under a new message id (the rescuer's resend):
	// no second effect, the last reply again. "The message id is not
	// signed": the old signature still holds.
	resendA := newID()
	send(t, prod, payTopic, sagaA, set(cmdA, wire.HeaderMessageID, resendA), value)
	waitReplies(keyA, 2)

	// 4. Bad commands, each of which the doc says is dead-lettered without a
	// reply. Each has its own step key, so that a reply would show.
	big := strings.Repeat("k", 10240)
	bad := map[string]func(sagaID, key string) ([]hdr, []byte){
		"unsigned": func(s, k string) ([]hdr, []byte) {
			return drop(command("pay.charge", s, k, wire.Forward, value), wire.HeaderSignature), value
		},
		"tampered value": func(s, k string) ([]hdr, []byte) {
			return command("pay.charge", s, k, wire.Forward, value), []byte(`{"order_id":"o-42","amount_cents":1,"currency":"EUR"}`)
		},
		"tampered reply-to": func(s, k string) ([]hdr, []byte) {
			return set(command("pay.charge", s, k, wire.Forward, value), wire.HeaderReplyTo, "sagaflow.commands.q.replies"), value
		},
		"signed with another key": func(s, k string) ([]hdr, []byte) {
			hs := drop(command("pay.charge", s, k, wire.Forward, value), wire.HeaderSignature)
			return append(hs, hdr{wire.HeaderSignature, signHand([]byte("other key"), hs, value)}), value
		},
		"missing step key": func(s, k string) ([]hdr, []byte) {
			return resign(drop(command("pay.charge", s, k, wire.Forward, value), wire.HeaderStepKey), value), value
		},
		"missing reply-to": func(s, k string) ([]hdr, []byte) {
			return resign(drop(command("pay.charge", s, k, wire.Forward, value), wire.HeaderReplyTo), value), value
		},
		"forged saga id": func(s, k string) ([]hdr, []byte) {
			return command("pay.charge", newID(), k, wire.Forward, value), value
		},
		"direction disagrees": func(s, k string) ([]hdr, []byte) {
			return command("pay.charge", s, k, wire.Compensate, value), value
		},
		"reply-to not allowed": func(s, k string) ([]hdr, []byte) {
			return resign(set(command("pay.charge", s, k, wire.Forward, value), wire.HeaderReplyTo, "orders.events"), value), value
		},
		"key does not parse": func(s, k string) ([]hdr, []byte) {
			return command("pay.charge", s, s+"/charge/forward", wire.Forward, value), value
		},
		"NUL in step key": func(s, k string) ([]hdr, []byte) {
			return command("pay.charge", s, s+"/ch\x00arge/forward/0", wire.Forward, value), value
		},
		"invalid UTF-8 in step key": func(s, k string) ([]hdr, []byte) {
			return command("pay.charge", s, s+"/ch\xffarge/forward/0", wire.Forward, value), value
		},
		"10 kB step key": func(s, k string) ([]hdr, []byte) {
			return command("pay.charge", s, s+"/"+big+"/forward/0", wire.Forward, value), value
		},
		"repeated step key header": func(s, k string) ([]hdr, []byte) {
			hs := command("pay.charge", s, k, wire.Forward, value)
			return append(hs, hdr{wire.HeaderStepKey, k}), value
		},
		"unknown type": func(s, k string) ([]hdr, []byte) {
			return command("pay.unknown", s, k, wire.Forward, value), value
		},
		"NUL in type": func(s, k string) ([]hdr, []byte) {
			return command("pay.charge\x00", s, k, wire.Forward, value), value
		},
		"10 kB type": func(s, k string) ([]hdr, []byte) {
			return command(big, s, k, wire.Forward, value), value
		},
		"10 kB reply-to": func(s, k string) ([]hdr, []byte) {
			return resign(set(command("pay.charge", s, k, wire.Forward, value), wire.HeaderReplyTo, big), value), value
		},
	}
	badKeys := map[string]string{}
	for name, build := range bad {
		s := newID()
		k := s + "/charge/forward/0"
		badKeys[name] = k
		hs, v := build(s, k)
		send(t, prod, payTopic, s, hs, v)
	}

	// 4b. A message id that PostgreSQL cannot store is not a check of
	// "Remote commands"; package inbox says it is recorded as its SHA-256, so
	// the command is served, once, even when delivered twice.
	oddIDs := map[string]string{"10 kB message id": big, "NUL in message id": "id\x00", "invalid UTF-8 message id": "id\xff"}
	oddKeys := map[string]string{}
	for name, id := range oddIDs {
		s := newID()
		k := s + "/charge/forward/0"
		oddKeys[name] = k
		hs := set(command("pay.charge", s, k, wire.Forward, value), wire.HeaderMessageID, id)
		send(t, prod, payTopic, s, hs, value)
		send(t, prod, payTopic, s, hs, value)
	}

	// 5. A good command behind them all on the one partition.
	sagaB := newID()
	keyB := sagaB + "/charge/forward/0"
	send(t, prod, payTopic, sagaB, command("pay.charge", sagaB, keyB, wire.Forward, value), value)
	waitReplies(keyB, 1)

	// 5b. A command whose message id (not signed) is 10 kB long, with a NUL
	// byte and invalid UTF-8: it is carried out, and its reply names it as
	// JSON can carry it (wire.Reply.InReplyTo; a NUL stays, invalid UTF-8
	// becomes U+FFFD). No engine sent such an id, so the engine would take a
	// refusal naming it as stale.
	sagaD := newID()
	keyD := sagaD + "/charge/forward/0"
	hostileID := strings.Repeat("i", 10<<10) + "\x00\xff"
	send(t, prod, payTopic, sagaD, set(command("pay.charge", sagaD, keyD, wire.Forward, value), wire.HeaderMessageID, hostileID), value)
	waitReplies(keyD, 1)
	d, err := wire.DecodeReply(replies.with(wire.HeaderStepKey, keyD)[0].Value)
	require.NoError(t, err)
	require.True(t, d.OK)
	require.Equal(t, strings.Repeat("i", 10<<10)+"\x00\ufffd", d.InReplyTo)

	// 6. A compensation for a step whose forward never came: it succeeds,
	// and the forward, arriving late, is refused with compensated_before_run.
	sagaC := newID()
	send(t, prod, payTopic, sagaC, command("pay.refund", sagaC, sagaC+"/charge/compensate/0", wire.Compensate, value), value)
	waitReplies(sagaC+"/charge/compensate/0", 1)
	send(t, prod, payTopic, sagaC, command("pay.charge", sagaC, sagaC+"/charge/forward/0", wire.Forward, value), value)
	waitReplies(sagaC+"/charge/forward/0", 1)
	late, err := wire.DecodeReply(replies.with(wire.HeaderStepKey, sagaC+"/charge/forward/0")[0].Value)
	require.NoError(t, err)
	require.False(t, late.OK)
	require.Equal(t, participant.CodeCompensatedBeforeRun, late.Code)

	// Give a straggler reply to a duplicate time to show.
	time.Sleep(300 * time.Millisecond)
	require.Len(t, replies.with(wire.HeaderStepKey, keyA), 2, "A: one reply, and one more for the resend under a new id; none for the same message twice")
	a1, _ := wire.DecodeReply(replies.with(wire.HeaderStepKey, keyA)[0].Value)
	a2, _ := wire.DecodeReply(replies.with(wire.HeaderStepKey, keyA)[1].Value)
	// The last reply again, as the answer to the command that asked for it
	// (wire.Reply.InReplyTo).
	firstA := ""
	for _, h := range cmdA {
		if h.k == wire.HeaderMessageID {
			firstA = h.v
		}
	}
	require.Equal(t, firstA, a1.InReplyTo, "the reply names the command it answers")
	require.Equal(t, resendA, a2.InReplyTo, "the reply sent again names the command that asked for it")
	a1.InReplyTo, a2.InReplyTo = "", ""
	require.Equal(t, a1, a2, "the last reply again")
	id1, _ := header(replies.with(wire.HeaderStepKey, keyA)[0], wire.HeaderMessageID)
	id2, _ := header(replies.with(wire.HeaderStepKey, keyA)[1], wire.HeaderMessageID)
	require.NotEqual(t, id1, id2, "the reply sent again has a new message id")

	var replied []string
	for name, k := range badKeys {
		if n := len(replies.with(wire.HeaderStepKey, k)); n > 0 {
			replied = append(replied, name)
		}
	}
	t.Logf("replied: %v, effects %d", replied, effects.Load())
	require.Empty(t, replied, "commands the doc says get no reply")
	for name, k := range oddKeys {
		waitReplies(k, 1)
		require.Len(t, replies.with(wire.HeaderStepKey, k), 1, "%s: one reply for a message delivered twice", name)
	}
	require.EqualValues(t, 3+len(oddIDs), effects.Load(), "commands A, B and D and each odd-id command ran once (duplicates ran no handler)")
	var dead int
	require.NoError(t, pool.QueryRow(context.Background(), "SELECT count(*) FROM "+migrations.QuoteSchema(schema)+".dead_letters").Scan(&dead))
	require.Equal(t, len(bad), dead, "each bad command dead-lettered once")
}
