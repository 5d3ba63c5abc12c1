package review12_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

// inReplyTo returns the in_reply_to of a reply payload.
func inReplyTo(t *testing.T, payload []byte) string {
	t.Helper()
	r, err := wire.DecodeReply(payload)
	require.NoError(t, err)
	return r.InReplyTo
}

// A forward remote step after the pivot (Retriable) whose command is refused
// fails the saga. The operator fixes the cause and resumes: the step's
// command is sent again under the same key. A copy of the old refusal,
// published after the resume, names the old command: it must be dropped,
// and the saga completes as the participant's answer to the new command
// says (docs/protocol.md "Replies", saga/doc.go on Remote).
func TestStaleRefusalAfterResumeOfAForwardStep(t *testing.T) {
	t.Parallel()
	for _, allSteps := range []bool{false, true} {
		t.Run(map[bool]string{false: "hybrid", true: "kafka-mode"}[allSteps], func(t *testing.T) {
			t.Parallel()
			staleRefusalAfterResumeOfAForwardStep(t, allSteps)
		})
	}
}

func staleRefusalAfterResumeOfAForwardStep(t *testing.T, allSteps bool) {
	ctx := context.Background()
	s := newSystem(t, opts{pivot: true, allSteps: allSteps})
	id := s.start(t, checkout{OrderID: "o-fwd", Amount: 500}, nil)
	in := waitEnded(t, s.engine, id)
	require.Equal(t, saga.StatusFailed, in.Status, "a refused Retriable step fails the saga")
	require.Equal(t, "card_declined", in.LastError.Code)
	key := stepKey(id, "charge", steps.Forward, 0)
	require.Equal(t, 1, s.payments.Count(t, "SELECT count(*) FROM "+s.payments.Table("outbox")+" WHERE step_key = $1 AND type = 'sagaflow.reply'", key))
	var oldPayload []byte
	require.NoError(t, s.payments.Pool.QueryRow(ctx, "SELECT payload FROM "+s.payments.Table("outbox")+" WHERE step_key = $1 AND type = 'sagaflow.reply'", key).Scan(&oldPayload))
	oldCmd := inReplyTo(t, oldPayload)
	require.NotEmpty(t, oldCmd, "the Go participant names the command in every reply")

	g := testkit.NewGate()
	s.chargeGate.Store(g)
	s.declineOver.Store(10_000)
	require.NoError(t, s.engine.Resume(ctx, id, "limit raised"))
	newCmd := waitAt(t, s.engine, s.orders, id, "charge", steps.Forward)
	testkit.WaitFor(t, wait, "the resumed charge in the payments handler", func() bool { return g.Entered() >= 1 })
	require.NotEqual(t, oldCmd, newCmd, "the resume sent a new command")

	stale := s.engine.Stats().StaleDiscarded
	testkit.CopyReplies(t, s.payments.DB, key)
	testkit.WaitFor(t, wait, "the copy of the refusal at the engine", func() bool {
		return s.engine.Stats().StaleDiscarded > stale || get(t, s.engine, id).Status.Terminal()
	})
	cur := get(t, s.engine, id)
	require.Equal(t, saga.StatusRunning, cur.Status, "the copy of the old refusal failed the resumed forward step: %+v", cur.LastError)
	testkit.WaitFor(t, wait, "the copy on the reply topic", func() bool { return len(replyOnTopic(t, s.kc, key)) >= 2 })
	testkit.Hold(t, time.Second, "the resumed step still waiting for its answer", func() bool {
		return get(t, s.engine, id).Status == saga.StatusRunning
	})

	g.Open()
	in = waitEnded(t, s.engine, id)
	require.Equal(t, saga.StatusCompleted, in.Status, "%+v", in.LastError)
	var st checkout
	require.NoError(t, in.DecodeState(&st))
	require.Equal(t, "ch_o-fwd", st.ChargeID)
	require.Equal(t, 1, s.payments.Count(t, "SELECT count(*) FROM "+s.payments.Table("charges")))
}

// After Rerun (a new epoch), neither a copy of the old epoch's refusal nor a
// refusal under the new key that names the old epoch's command may fail the
// rerun step.
func TestStaleRefusalAfterRerun(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newSystem(t, opts{})
	id := s.start(t, checkout{OrderID: "o-rerun", Amount: 500}, nil)
	in := waitEnded(t, s.engine, id)
	require.Equal(t, saga.StatusCompensated, in.Status)
	oldKey := stepKey(id, "charge", steps.Forward, 0)
	var oldPayload []byte
	require.NoError(t, s.payments.Pool.QueryRow(ctx, "SELECT payload FROM "+s.payments.Table("outbox")+" WHERE step_key = $1 AND type = 'sagaflow.reply'", oldKey).Scan(&oldPayload))
	oldCmd := inReplyTo(t, oldPayload)
	require.NotEmpty(t, oldCmd)

	g := testkit.NewGate()
	s.chargeGate.Store(g)
	s.declineOver.Store(10_000)
	require.NoError(t, s.engine.Rerun(ctx, id, "reserve", "limit raised")) // a compensated saga reruns from its first step
	newCmd := waitAt(t, s.engine, s.orders, id, "charge", steps.Forward)
	testkit.WaitFor(t, wait, "the rerun charge in the payments handler", func() bool { return g.Entered() >= 1 })
	cur := get(t, s.engine, id)
	require.Equal(t, 1, cur.Epoch, "Rerun runs under a new epoch")
	newKey := stepKey(id, "charge", steps.Forward, cur.Epoch)

	// The old refusal again, and a refusal of the new key naming the old command.
	testkit.CopyReplies(t, s.payments.DB, oldKey)
	var forged wire.Reply
	require.NoError(t, json.Unmarshal(oldPayload, &forged))
	require.False(t, forged.OK)
	inject(t, s.kc, id, nil, newKey, oldPayload)
	testkit.Hold(t, 2*time.Second, "the rerun saga still waiting for its charge", func() bool {
		c := get(t, s.engine, id)
		return c.Status == saga.StatusRunning && c.Step == "charge" && commandID(t, s.orders, id) == newCmd
	})

	g.Open()
	in = waitEnded(t, s.engine, id)
	require.Equal(t, saga.StatusCompleted, in.Status, "%+v", in.LastError)
}

// A remote compensation whose reply is late is sent again under the same
// key. The participant refuses the first command late (after the timeout)
// and carries out the second: the late refusal names the first command and
// is stale; the saga ends compensated, the release done once.
func TestLateRefusalOfAResentCompensationIsStale(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newSystem(t, opts{releaseAttempts: 3})
	g := testkit.NewGate()
	s.releaseGate.Store(g)
	id := s.start(t, checkout{OrderID: "o-retry", Amount: 500}, nil) // declined: compensates
	first := waitAt(t, s.engine, s.orders, id, "reserve", steps.Compensate)
	testkit.WaitFor(t, wait, "the first release in its handler", func() bool { return g.Entered() >= 1 })
	var second string
	testkit.WaitFor(t, wait, "the release sent again after the reply timeout", func() bool {
		second = commandID(t, s.orders, id)
		return second != "" && second != first
	})
	require.Equal(t, saga.StatusCompensating, get(t, s.engine, id).Status)
	s.refuseNext.Store(1) // the first command, released from the gate, is refused
	g.Open()
	in := waitEnded(t, s.engine, id)
	require.Equal(t, saga.StatusCompensated, in.Status, "the late refusal of the first release decided the saga: %+v", in.LastError)
	require.Equal(t, "card_declined", in.LastError.Code, "the saga keeps the cause of its compensation")
	require.Equal(t, 1, s.inventory.Count(t, "SELECT count(*) FROM "+s.inventory.Table("stock_moves")+" WHERE move = 'release'"))
	_ = ctx
}

// A success is applied whatever command it names (docs/protocol.md): a
// success reply naming some other command completes the awaited step.
func TestSuccessNamingAnotherCommandCompletesTheStep(t *testing.T) {
	t.Parallel()
	s := newSystem(t, opts{noPayments: true})
	id := s.start(t, checkout{OrderID: "o-succ", Amount: 40}, nil)
	cmd := waitAt(t, s.engine, s.orders, id, "charge", steps.Forward)
	other := uuid.NewString()
	require.NotEqual(t, cmd, other)
	p, err := wire.EncodeReply(wire.Reply{OK: true, Result: json.RawMessage(`{"charge_id":"ch_other"}`), InReplyTo: other})
	require.NoError(t, err)
	inject(t, s.kc, id, nil, stepKey(id, "charge", steps.Forward, 0), p)
	in := waitEnded(t, s.engine, id)
	require.Equal(t, saga.StatusCompleted, in.Status, "%+v", in.LastError)
	var st checkout
	require.NoError(t, in.DecodeState(&st))
	require.Equal(t, "ch_other", st.ChargeID)
}

// DecodeReply: in_reply_to must be a string when present (CHANGELOG, wire
// doc); its text is taken as sent.
func TestDecodeReplyInReplyTo(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{`5`, `true`, `{}`, `[]`} {
		_, err := wire.DecodeReply([]byte(`{"ok":false,"in_reply_to":` + bad + `}`))
		require.Error(t, err, "in_reply_to %s", bad)
		require.Contains(t, err.Error(), "in_reply_to", "the error names the field")
	}
	long := strings.Repeat("a", 10240)
	r, err := wire.DecodeReply([]byte(`{"ok":false,"in_reply_to":"` + long + `"}`))
	require.NoError(t, err)
	require.Equal(t, long, r.InReplyTo)
	r, err = wire.DecodeReply([]byte(`{"ok":false,"in_reply_to":"a\u0000b"}`))
	require.NoError(t, err)
	require.Equal(t, "a\x00b", r.InReplyTo)
	r, err = wire.DecodeReply([]byte("{\"ok\":false,\"in_reply_to\":\"\xff\xfe\"}"))
	require.NoError(t, err, "invalid UTF-8 becomes U+FFFD, as encoding/json takes it")
	require.NotEmpty(t, r.InReplyTo)
}

// JSON null is "not said", as for the reply's other optional fields (F1:
// the docs first said a present non-string made the reply malformed; they now
// say null counts as absent, which is what serialisers that write null for an
// empty optional field need).
func TestDecodeReplyInReplyToNullIsNotSaid(t *testing.T) {
	t.Parallel()
	r, err := wire.DecodeReply([]byte(`{"ok":false,"code":"x","in_reply_to":null}`))
	require.NoError(t, err)
	require.Equal(t, wire.Reply{Code: "x"}, r)
}

// Hostile in_reply_to values on the wire, each on its own saga waiting for
// its charge (payments down). Each hostile refusal (code "hostile") is
// followed, on the same partition, by a genuine refusal naming the awaited
// command (code "genuine"): the code the saga ends with tells which one was
// applied.
func TestHostileInReplyTo(t *testing.T) {
	t.Parallel()
	s := newSystem(t, opts{noPayments: true})
	type tc struct {
		name     string
		value    func(cmd string) string // raw JSON of in_reply_to
		expect   string                  // "stale", "applied" or "malformed"
		deadLike string
	}
	str := func(v string) string { b, _ := json.Marshal(v); return string(b) }
	cases := []tc{
		{"nul", func(cmd string) string { return str(cmd + "\x00") }, "stale", ""},
		{"nul-only", func(string) string { return `"\u0000"` }, "stale", ""},
		{"invalid-utf8", func(cmd string) string { return "\"" + cmd[:8] + "\xff\xfe\"" }, "stale", ""},
		{"10kB", func(string) string { return str(strings.Repeat("x", 10240)) }, "stale", ""},
		{"10kB-prefixed-by-the-id", func(cmd string) string { return str(cmd + strings.Repeat(" ", 10240)) }, "stale", ""},
		{"other-uuid", func(string) string { return str(uuid.NewString()) }, "stale", ""},
		{"number", func(string) string { return `12345` }, "malformed", "%"},
		{"object", func(cmd string) string { return `{"id":` + str(cmd) + `}` }, "malformed", "%"},
		{"null", func(string) string { return `null` }, "applied", ""},       // null = not said (F1)
		{"empty-string", func(string) string { return `""` }, "applied", ""}, // "" = the participant does not say
		{"upper-case-of-the-awaited-id", func(cmd string) string { return str(strings.ToUpper(cmd)) }, "applied", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			id := s.start(t, checkout{OrderID: "o-" + c.name, Amount: 40}, nil)
			cmd := waitAt(t, s.engine, s.orders, id, "charge", steps.Forward)
			key := stepKey(id, "charge", steps.Forward, 0)
			inject(t, s.kc, id, nil, key, []byte(`{"ok":false,"error":"hostile","code":"hostile","in_reply_to":`+c.value(cmd)+`}`))
			inject(t, s.kc, id, nil, key, []byte(`{"ok":false,"error":"genuine","code":"genuine","in_reply_to":`+str(cmd)+`}`))
			in := waitEnded(t, s.engine, id)
			require.Equal(t, saga.StatusCompensated, in.Status, "%+v", in.LastError)
			switch c.expect {
			case "applied":
				require.Equal(t, "hostile", in.LastError.Code, "a refusal naming the awaited command (or none) must be applied")
			case "stale":
				require.Equal(t, "genuine", in.LastError.Code, "a refusal naming another command must be dropped as stale")
				require.Zero(t, deadFor(t, s.orders, id, "%"), "a stale refusal is dropped, not dead-lettered")
			case "malformed":
				require.Equal(t, "genuine", in.LastError.Code, "a reply with a non-string in_reply_to is malformed, never applied")
				require.Equal(t, 1, deadFor(t, s.orders, id, c.deadLike), "a malformed reply is dead-lettered, not dropped silently")
			}
		})
	}
}

// With signing on, the payload is signed: a real refusal whose in_reply_to
// was rewritten (to name the command the resumed saga waits for) no longer
// verifies, is dead-lettered as unverified, and does not fail the saga.
func TestAlteredInReplyToIsUnverified(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newSystem(t, opts{key: []byte("review12 shared signing key")})
	s.inventoryDown.Store(true)
	id := s.start(t, checkout{OrderID: "o-signed", Amount: 500}, nil)
	in := waitEnded(t, s.engine, id)
	require.Equal(t, saga.StatusFailed, in.Status)
	require.Equal(t, "warehouse_closed", in.LastError.Code)
	key := stepKey(id, "reserve", steps.Compensate, 0)
	var old []kafka.Message
	testkit.WaitFor(t, wait, "the signed refusal on the reply topic", func() bool {
		old = replyOnTopic(t, s.kc, key)
		return len(old) >= 1
	})
	signed := false
	for _, h := range old[0].Headers {
		signed = signed || h.Key == wire.HeaderSignature
	}
	require.True(t, signed, "the participant signs its replies")

	g := testkit.NewGate()
	s.releaseGate.Store(g)
	s.inventoryDown.Store(false)
	require.NoError(t, s.engine.Resume(ctx, id, "warehouse open again"))
	cmd := waitAt(t, s.engine, s.orders, id, "reserve", steps.Compensate)
	testkit.WaitFor(t, wait, "the resumed release in its handler", func() bool { return g.Entered() >= 1 })

	var r map[string]any
	require.NoError(t, json.Unmarshal(old[0].Value, &r))
	require.NotEqual(t, cmd, r["in_reply_to"])
	r["in_reply_to"] = cmd
	altered, err := json.Marshal(r)
	require.NoError(t, err)
	var hdrs []kafka.Header
	for _, h := range old[0].Headers {
		if h.Key == wire.HeaderMessageID { // not signed: a fresh id, so no deduplication hides it
			h.Value = []byte(uuid.NewString())
		}
		hdrs = append(hdrs, h)
	}
	inject(t, s.kc, id, hdrs, key, altered)
	testkit.WaitFor(t, wait, "the altered refusal dead-lettered as unverified", func() bool {
		require.NotEqual(t, saga.StatusFailed, get(t, s.engine, id).Status, "the altered refusal was applied")
		return deadFor(t, s.orders, id, "unverified%") >= 1
	})
	require.Equal(t, saga.StatusCompensating, get(t, s.engine, id).Status)
	g.Open()
	in = waitEnded(t, s.engine, id)
	require.Equal(t, saga.StatusCompensated, in.Status, "%+v", in.LastError)
	require.Equal(t, 1, s.inventory.Count(t, "SELECT count(*) FROM "+s.inventory.Table("stock_moves")+" WHERE move = 'release'"))
}

// Two tenants (two engine schemas) on one cluster, sharing the default reply
// topic, each with a saga of the same id (StartOpts.ID). Tenant A's charge
// is refused; the refusal reaches tenant B's engine too, where the saga of
// the same id waits at the same step key for its own charge command: it
// names A's command, so B must drop it.
func TestTenantsSharingAReplyTopic(t *testing.T) {
	t.Parallel()
	a := newSystem(t, opts{})
	bSvc := newService(t, a.kc)
	bDef := checkoutDef(opts{}, "payments-b.commands") // nobody serves it
	b := newEngine(t, a.kc, bSvc, bDef, nil, false)

	id := uuid.Must(uuid.NewV7())
	_, err := saga.Start(context.Background(), b, bDef, checkout{OrderID: "o-b", Amount: 40}, &saga.StartOpts{ID: id})
	require.NoError(t, err)
	bCmd := waitAt(t, b, bSvc, id, "charge", steps.Forward)

	a.start(t, checkout{OrderID: "o-a", Amount: 500}, &saga.StartOpts{ID: id})
	in := waitEnded(t, a.engine, id)
	require.Equal(t, saga.StatusCompensated, in.Status)
	require.Equal(t, "card_declined", in.LastError.Code)
	require.NotEmpty(t, replyOnTopic(t, a.kc, stepKey(id, "charge", steps.Forward, 0)), "A's refusal is on the shared topic")
	testkit.WaitFor(t, wait, "tenant B's engine reading the shared reply topic (it drops A's replies as stale)", func() bool {
		return b.Stats().StaleDiscarded >= 1
	})
	testkit.Hold(t, 2*time.Second, "tenant B's saga untouched by tenant A's refusal", func() bool {
		c := get(t, b, id)
		return c.Status == saga.StatusRunning && c.Step == "charge" && commandID(t, bSvc, id) == bCmd
	})
}

// An operator resumes a saga whose compensation ran out of attempts while
// the participant's handler still runs the old command. That handler then
// refuses (its refusal names the old command) and the resumed command is
// carried out: the saga ends compensated.
func TestResumeWhileTheOldHandlerRuns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newSystem(t, opts{releaseAttempts: 1})
	g := testkit.NewGate()
	s.releaseGate.Store(g)
	id := s.start(t, checkout{OrderID: "o-op", Amount: 500}, nil)
	old := waitAt(t, s.engine, s.orders, id, "reserve", steps.Compensate)
	testkit.WaitFor(t, wait, "the release in its handler", func() bool { return g.Entered() >= 1 })
	in := waitEnded(t, s.engine, id)
	require.Equal(t, saga.StatusFailed, in.Status, "one release attempt, no reply in time: failed")
	require.NoError(t, s.engine.Resume(ctx, id, "operator: try the release again"))
	var cur string
	testkit.WaitFor(t, wait, "the release sent again by the resume", func() bool {
		cur = commandID(t, s.orders, id)
		return cur != "" && cur != old
	})
	s.refuseNext.Store(1) // the old command's handler, released now, refuses
	g.Open()
	in = waitEnded(t, s.engine, id)
	require.Equal(t, saga.StatusCompensated, in.Status, "the old command's refusal decided the resumed saga: %+v", in.LastError)
	require.Equal(t, 1, s.inventory.Count(t, "SELECT count(*) FROM "+s.inventory.Table("stock_moves")+" WHERE move = 'release'"))
}

// A saga paused (Engine.Pause) while its reserve command runs at the
// participant: the reserve's success is recorded, and the charge command it
// writes next waits for the pause. Resume releases it; the participant
// refuses it, naming the command it received. That refusal must be applied
// (the saga compensates with card_declined), not dropped as naming another
// command than the one the saga recorded (which would leave the saga to its
// reply timeout).
func TestRefusalOfACommandHeldByAPause(t *testing.T) {
	t.Parallel()
	for _, allSteps := range []bool{false, true} {
		t.Run(map[bool]string{false: "hybrid", true: "kafka-mode"}[allSteps], func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			s := newSystem(t, opts{allSteps: allSteps})
			g := testkit.NewGate()
			s.reserveGate.Store(g)
			id := s.start(t, checkout{OrderID: "o-paused", Amount: 500}, nil)
			testkit.WaitFor(t, wait, "the reserve in its handler", func() bool { return g.Entered() >= 1 })
			require.NoError(t, s.engine.Pause(ctx, id, "operator looks at it"))
			g.Open()
			testkit.WaitFor(t, wait, "the paused saga past its reserve", func() bool {
				in := get(t, s.engine, id)
				require.False(t, in.Status.Terminal(), "%s %+v", in.Status, in.LastError)
				return in.Paused != nil && in.Step == "charge"
			})
			testkit.Hold(t, 500*time.Millisecond, "no charge while paused", func() bool {
				return s.payments.Count(t, "SELECT count(*) FROM "+s.payments.Table("inbox")) == 0
			})
			require.NoError(t, s.engine.Resume(ctx, id, "go on"))
			in := waitEnded(t, s.engine, id)
			require.Equal(t, saga.StatusCompensated, in.Status, "%+v", in.LastError)
			require.Equal(t, "card_declined", in.LastError.Code, "the participant's refusal of the released command was not applied")
		})
	}
}
