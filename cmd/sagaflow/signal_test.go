package main

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// parcel is the state of the fixture saga "fulfil": pay, wait for the
// warehouse's "picked" signal (48 hours at most), ship.
type parcel struct {
	ID       string `json:"id"`
	PickedBy string `json:"picked_by,omitempty"`
}

// picked is the payload of the signal "picked".
type picked struct {
	By string `json:"by"`
}

func defineFulfil() *saga.Definition[parcel] {
	ok := func(context.Context, *saga.StepRun, *parcel) error { return nil }
	return saga.Define("fulfil",
		saga.Step[parcel]{Name: "pay", Action: ok},
		saga.Step[parcel]{Name: "await-picked", Wait: saga.OnSignal("picked",
			func(_ context.Context, _ *saga.StepRun, p *parcel, in picked) error {
				p.PickedBy = in.By
				return nil
			}).Timeout(48 * time.Hour)},
		saga.Step[parcel]{Name: "ship", Action: ok},
	).WithDeadline(72 * time.Hour)
}

// startFulfil starts an engine that knows the fulfil saga and starts one
// for each key, and waits until each waits for its signal.
func (f *fixture) startFulfil(t *testing.T, keys ...string) (*saga.Engine, []uuid.UUID) {
	t.Helper()
	ctx := context.Background()
	def := defineFulfil()
	e, _ := testkit.StartEngine(t, f.Pool, f.Config(), def)
	var ids []uuid.UUID
	for _, k := range keys {
		st, err := saga.Start(ctx, e, def, parcel{ID: k}, &saga.StartOpts{BusinessKey: k})
		require.NoError(t, err)
		sagatest.Wait(t, e, st.ID, sagatest.Cond("wait for its signal", func(in *saga.Instance) bool {
			return in.Wait != nil && in.Wait.Kind == "signal"
		}), nil)
		ids = append(ids, st.ID)
	}
	return e, ids
}

type signalOut struct {
	SagaID    *uuid.UUID `json:"saga_id"`
	Signal    string     `json:"signal"`
	ID        string     `json:"id"`
	Seq       int64      `json:"seq"`
	Duplicate bool       `json:"duplicate"`
	Result    string     `json:"result"`
	Message   string     `json:"message"`
	Error     string     `json:"error"`
	Code      int        `json:"code"`
}

type showOut struct {
	saga.Instance
	Signals []struct {
		Seq     int64
		Name    string
		ID      string
		Status  string
		Error   string
		Step    string
		Payload map[string]any
	} `json:"signals"`
}

func TestSignalCompletesAWaitingSaga(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	e, ids := f.startFulfil(t, "p-1", "p-2")
	s1, s2 := ids[0], ids[1]

	// What the sagas wait for, in show and list.
	out := f.cli(t, "show", s1.String()).ok(t)
	requireInOrder(t, out, "step:", "await-picked", "waits for:", "signal:picked until 20", "deadline:", "20", "parent:", "-")
	require.NotContains(t, out, "signals (")
	in := decode[showOut](t, f.cli(t, "show", s1.String(), "--json"))
	require.Equal(t, "signal", in.Wait.Kind)
	require.Equal(t, "picked", in.Wait.For)
	require.NotNil(t, in.Wait.Until)
	require.NotNil(t, in.Deadline)
	require.True(t, in.Deadline.After(*in.Wait.Until), "the 72h deadline is after the 48h wait")
	require.Contains(t, out, "until "+formatTime(*in.Wait.Until))
	require.Contains(t, out, "deadline:      "+formatTime(*in.Deadline))
	require.NotNil(t, in.Signals)
	require.Empty(t, in.Signals)

	table := f.cli(t, "list", "--waiting").ok(t)
	lines := strings.Split(strings.TrimSpace(table), "\n")
	require.Len(t, lines, 3, table)
	col := strings.Index(lines[0], "WAIT")
	for _, l := range lines[1:] {
		require.Equal(t, "signal:picked until ", l[col:col+len("signal:picked until ")], table)
	}

	// By id, with a payload: the saga takes it and completes.
	r := f.cli(t, "signal", s1.String(), "picked", "--payload", `{"by":"anna"}`, "--id", "wh-1")
	out = r.ok(t)
	require.Equal(t, `signal "picked" sent to saga `+s1.String()+` (seq `, out[:len(`signal "picked" sent to saga `)+36+6])
	require.Contains(t, out, `id "wh-1"`)
	testkit.WaitStatus(t, f.DB, s1, saga.StatusCompleted)
	got, err := e.Get(ctx, s1)
	require.NoError(t, err)
	var p parcel
	require.NoError(t, got.DecodeState(&p))
	require.Equal(t, "anna", p.PickedBy)
	require.Nil(t, got.Wait)

	show := f.cli(t, "show", s1.String()).ok(t)
	requireInOrder(t, show, "waits for:", "-", "timeline", "signal_received", "saga_completed",
		"signals (1):", "picked", `id wh-1`, "delivered", "step await-picked, epoch 0", "state:", `"picked_by": "anna"`)
	sh := decode[showOut](t, f.cli(t, "show", s1.String(), "--json"))
	require.Len(t, sh.Signals, 1)
	require.Equal(t, "picked", sh.Signals[0].Name)
	require.Equal(t, "wh-1", sh.Signals[0].ID)
	require.Equal(t, "delivered", sh.Signals[0].Status)
	require.Equal(t, "await-picked", sh.Signals[0].Step)
	require.Equal(t, map[string]any{"by": "anna"}, sh.Signals[0].Payload)

	// The same id again: a duplicate, nothing new written.
	before := f.Count(t, "SELECT count(*) FROM "+f.Table("saga_signals"))
	doc := decode[signalOut](t, f.cli(t, "--json", "signal", s1.String(), "picked", "--id", "wh-1"))
	require.True(t, doc.Duplicate)
	require.Equal(t, "duplicate", doc.Result)
	require.Equal(t, s1, *doc.SagaID)
	require.Equal(t, sh.Signals[0].Seq, doc.Seq)
	require.Equal(t, before, f.Count(t, "SELECT count(*) FROM "+f.Table("saga_signals")))

	// The saga has ended: a new signal is recorded as rejected.
	msg := f.cli(t, "signal", s1.String(), "picked", "--id", "wh-late").failed(t, exitFailed)
	require.Contains(t, msg, `signal "picked" to saga `+s1.String()+": recorded as rejected (seq ")
	require.Contains(t, msg, "the saga is not running (its status is completed)")
	require.Equal(t, before+1, f.Count(t, "SELECT count(*) FROM "+f.Table("saga_signals")))
	require.Equal(t, 1, f.Count(t, "SELECT count(*) FROM "+f.Table("saga_signals")+" WHERE status = 'rejected' AND signal_id = 'wh-late'"))
	r = f.cli(t, "--json", "signal", s1.String(), "picked", "--id", "wh-late")
	require.Equal(t, exitFailed, r.code)
	doc = decode[signalOut](t, r)
	require.Equal(t, "rejected", doc.Result)
	require.True(t, doc.Duplicate)
	require.Equal(t, exitFailed, doc.Code)
	require.Equal(t, `signal "picked" to saga `+s1.String()+`: a signal with id "wh-late" was recorded as rejected before (seq `+
		strconv.FormatInt(doc.Seq, 10)+"): the saga is not running (its status is completed)", doc.Error)

	// No such saga: recorded as rejected too, exit code 3.
	missing := uuid.New()
	msg = f.cli(t, "signal", missing.String(), "picked").failed(t, exitNotFound)
	require.Contains(t, msg, "recorded as rejected")
	require.Contains(t, msg, "no such saga")
	require.Equal(t, 1, f.Count(t, "SELECT count(*) FROM "+f.Table("saga_signals")+" WHERE target = $1 AND status = 'rejected'",
		missing.String()))
	msg = f.cli(t, "signal", "--saga", "fulfil", "--key", "p-nope", "picked", "--id", "x").failed(t, exitNotFound)
	require.Contains(t, msg, `saga "fulfil" with key "p-nope": recorded as rejected`)
	msg = f.cli(t, "signal", "--saga", "fulfil", "--key", "p-nope", "picked", "--id", "x").failed(t, exitNotFound)
	require.Contains(t, msg, `saga "fulfil" with key "p-nope": a signal with id "x" was recorded as rejected before (seq `)
	require.Contains(t, msg, "no such saga")

	// By name and business key, in JSON, without a payload.
	doc = decode[signalOut](t, f.cli(t, "signal", "--saga", "fulfil", "--key", "p-2", "picked", "--json"))
	require.Equal(t, s2, *doc.SagaID)
	require.Equal(t, "recorded", doc.Result)
	require.False(t, doc.Duplicate)
	_, err = uuid.Parse(doc.ID)
	require.NoError(t, err, "a signal without --id gets a UUID")
	testkit.WaitStatus(t, f.DB, s2, saga.StatusCompleted)
	require.Equal(t, "no sagas match\n", f.cli(t, "list", "--waiting").ok(t))
}

// TestSignalBadInput: every bad argument is refused with exit code 2 and an
// error that names it, and nothing is written.
func TestSignalBadInput(t *testing.T) {
	t.Parallel()
	f := setup(t)
	_, ids := f.startFulfil(t, "p-1")
	id := ids[0].String()
	written := func() int {
		return f.Count(t, "SELECT count(*) FROM "+f.Table("saga_signals")) +
			f.Count(t, "SELECT count(*) FROM "+f.Table("outbox")+" WHERE type = 'sagaflow.wake'")
	}
	long := strings.Repeat("x", 10_000)
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"NUL in name", []string{id, "pic\x00ked"}, "signal name contains a NUL byte"},
		{"invalid UTF-8 in name", []string{id, "pick\xffed"}, "signal name is not valid UTF-8"},
		{"long name", []string{id, long}, "signal name is 10000 bytes, more than 200"},
		{"empty name", []string{id, ""}, "signal name is empty"},
		{"NUL in id", []string{id, "picked", "--id", "a\x00b"}, "--id contains a NUL byte"},
		{"invalid UTF-8 in id", []string{id, "picked", "--id", "a\xfeb"}, "--id is not valid UTF-8"},
		{"long id", []string{id, "picked", "--id", long}, "--id is 10000 bytes"},
		{"empty id", []string{id, "picked", "--id", ""}, "--id is empty"},
		{"long key", []string{"--saga", "fulfil", "--key", long, "picked"}, "--key is 10000 bytes"},
		{"NUL in key", []string{"--saga", "fulfil", "--key", "p\x00", "picked"}, "--key contains a NUL byte"},
		{"long saga", []string{"--saga", long, "--key", "p-1", "picked"}, "--saga is 10000 bytes, more than 64"},
		{"payload not JSON", []string{id, "picked", "--payload", "{by: anna}"}, "--payload is not a JSON document"},
		{"payload of two values", []string{id, "picked", "--payload", `{} {}`}, "--payload is not a JSON document"},
		{"empty payload", []string{id, "picked", "--payload", ""}, "--payload is not a JSON document"},
		{"NUL in payload", []string{id, "picked", "--payload", "\"a\x00\""}, "--payload contains a NUL byte"},
		{"invalid UTF-8 in payload", []string{id, "picked", "--payload", "\"a\xff\""}, "--payload is not valid UTF-8"},
		{"id and key", []string{id, "picked", "--saga", "fulfil", "--key", "p-1"}, "give the saga's id or --saga and --key, not both"},
		{"key without saga", []string{"--key", "p-1", "picked"}, "--saga and --key go together"},
		{"saga without key", []string{"--saga", "fulfil", "picked"}, "--saga and --key go together"},
		{"no name", []string{id}, "missing signal name"},
		{"nothing", nil, "missing saga id and signal name"},
		{"no name by key", []string{"--saga", "fulfil", "--key", "p-1"}, "missing signal name"},
		{"extra argument", []string{id, "picked", "more"}, `unexpected argument "more"`},
		{"bad id", []string{"order-42", "picked"}, `saga id "order-42" is not a UUID`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			msg := f.cli(t, append([]string{"signal"}, tc.args...)...).failed(t, exitUsage)
			require.Contains(t, msg, "sagaflow: signal: "+tc.want)
			requireTerminalSafe(t, "stderr", msg)
			require.Zero(t, written())

			r := f.cli(t, append([]string{"signal", "--json"}, tc.args...)...)
			require.Equal(t, exitUsage, r.code)
			require.Contains(t, decode[jsonError](t, r).Error, tc.want)
			require.Zero(t, written())
		})
	}
	// A payload larger than the engine takes is refused by the library,
	// with the same exit code.
	big := `"` + strings.Repeat("x", 2<<20) + `"`
	msg := f.cli(t, "signal", id, "picked", "--payload", big).failed(t, exitUsage)
	require.Contains(t, msg, "Payload")
	require.Zero(t, written())
	require.Equal(t, saga.StatusRunning, f.status(t, ids[0]))
}

// TestSignalPayloadFromAFile: --payload-file takes a payload longer than one
// command-line argument holds (128 KiB on Linux; review27 O5), and what is
// wrong with it is named by that flag.
func TestSignalPayloadFromAFile(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	e, ids := f.startFulfil(t, "pf-1")
	dir := t.TempDir()
	big := filepath.Join(dir, "big.json")
	require.NoError(t, os.WriteFile(big, []byte(`{"by":"anna","note":"`+strings.Repeat("n", 200_000)+`"}`), 0o600))
	bad := filepath.Join(dir, "bad.json")
	require.NoError(t, os.WriteFile(bad, []byte(`{"by":`), 0o600))

	msg := f.cli(t, "signal", ids[0].String(), "picked", "--payload-file", bad).failed(t, exitUsage)
	require.Contains(t, msg, "--payload-file is not a JSON document")
	msg = f.cli(t, "signal", ids[0].String(), "picked", "--payload-file", filepath.Join(dir, "none.json")).failed(t, exitUsage)
	require.Contains(t, msg, "--payload-file: open")
	// Bytes PostgreSQL refuses, from a file: refused, naming the flag.
	for name, content := range map[string]string{"nul.json": "\"a\x00b\"", "bad.utf8.json": "\"a\xffb\""} {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
		msg = f.cli(t, "signal", ids[0].String(), "picked", "--payload-file", p).failed(t, exitUsage)
		require.Contains(t, msg, "signal: --payload-file ", name)
	}
	msg = f.cli(t, "signal", ids[0].String(), "picked", "--payload-file", big, "--payload", "{}").failed(t, exitUsage)
	require.Contains(t, msg, "not both")

	f.cli(t, "signal", ids[0].String(), "picked", "--payload-file", big, "--id", "file-1").ok(t)
	testkit.WaitStatus(t, f.DB, ids[0], saga.StatusCompleted)
	got, err := e.Get(ctx, ids[0])
	require.NoError(t, err)
	var p parcel
	require.NoError(t, got.DecodeState(&p))
	require.Equal(t, "anna", p.PickedBy)
	sigs, err := e.Signals(ctx, ids[0])
	require.NoError(t, err)
	require.Len(t, sigs, 1)
	require.Greater(t, len(sigs[0].Payload), 200_000, "the payload is stored whole")
}
