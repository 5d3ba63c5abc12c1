package review14

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// hostile is 10 kB of letters with NULs and invalid UTF-8 mixed in.
func hostile() string {
	var b strings.Builder
	letters := testkit.RandomLetters(10_000)
	for i := 0; i < len(letters); i += 100 {
		b.WriteString(letters[i : i+98])
		b.WriteString("\x00\xff")
	}
	return b.String()
}

// Signals whose name, ID, address or payload PostgreSQL cannot store are
// refused with ErrInvalidInput and write nothing; the saga still takes
// the next good signal, once.
func TestUnstorableSignalsAreRefused(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	def := chainDef(r, "refuse", chainOpts{})
	r.start(t, nil, def)
	ctx := context.Background()
	st, err := saga.Start(ctx, r.engine, def, ord{ID: "o-1"}, &saga.StartOpts{BusinessKey: "bk-1"})
	require.NoError(t, err)
	id := st.ID
	r.waiting(t, id, "await")
	big := testkit.RandomLetters(10_000)
	for _, c := range []struct {
		name string
		sig  saga.Signal
	}{
		{"name-nul", saga.Signal{SagaID: id, Name: "g\x00o", ID: "n1", Payload: "p"}},
		{"name-utf8", saga.Signal{SagaID: id, Name: "g\xffo", ID: "n2", Payload: "p"}},
		{"name-10k", saga.Signal{SagaID: id, Name: big, ID: "n3", Payload: "p"}},
		{"name-201", saga.Signal{SagaID: id, Name: strings.Repeat("a", saga.MaxSignalNameBytes+1), ID: "n4", Payload: "p"}},
		{"id-nul", saga.Signal{SagaID: id, Name: "go", ID: "i\x00d", Payload: "p"}},
		{"id-utf8", saga.Signal{SagaID: id, Name: "go", ID: "i\xffd", Payload: "p"}},
		{"id-10k", saga.Signal{SagaID: id, Name: "go", ID: big, Payload: "p"}},
		{"key-nul", saga.Signal{Saga: "refuse", BusinessKey: "bk-1\x00", Name: "go", ID: "k1", Payload: "p"}},
		{"key-utf8", saga.Signal{Saga: "refuse", BusinessKey: "bk-1\xff", Name: "go", ID: "k2", Payload: "p"}},
		{"saga-nul", saga.Signal{Saga: "ref\x00use", BusinessKey: "bk-1", Name: "go", ID: "k3", Payload: "p"}},
		{"payload-notjson", saga.Signal{SagaID: id, Name: "go", ID: "p1", Payload: json.RawMessage("not json")}},
		{"payload-bytes", saga.Signal{SagaID: id, Name: "go", ID: "p2", Payload: []byte{0xff, 0xfe}}},
		{"payload-cut", saga.Signal{SagaID: id, Name: "go", ID: "p3", Payload: json.RawMessage(`{"a":`)}},
		{"payload-rawnul", saga.Signal{SagaID: id, Name: "go", ID: "p4", Payload: json.RawMessage("\"a\x00b\"")}},
	} {
		_, err := r.engine.Signal(ctx, c.sig)
		require.Error(t, err, c.name)
		require.True(t, errors.Is(err, saga.ErrInvalidInput), "%s: %v", c.name, err)
	}
	require.Empty(t, r.signals(t, id), "nothing was written")
	in := r.get(t, id)
	require.NotNil(t, in.Wait, describe(in))
	require.Zero(t, r.fx.Count(t, id, "onsig"))

	res, err := r.engine.Signal(ctx, saga.Signal{Saga: "refuse", BusinessKey: "bk-1", Name: "go", ID: "good", Payload: "ok"})
	require.NoError(t, err)
	require.Equal(t, id, res.SagaID)
	in = r.ended(t, id)
	require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
	require.Equal(t, []string{"prep", "onsig", "act"}, r.fx.List(t, id))
	requireDelivered(t, r, id, "await")
}

// Hostile bytes in signals that are stored, in the handler's state, in the
// chained step's state and in its error, with healthy sagas in the same
// batch (one worker, the wake-ups released together): no panic, every
// healthy saga completes once, and a bad one fails at the step that took
// the bytes, with the wait's end kept when that step is the chained one.
func TestHostileBytesAroundTheChainedStep(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var acts, handlers tally
	evil := hostile()
	def := chainDef(r, "hostile", chainOpts{
		awaitRetry: noBackoff(2),
		actRetry:   noBackoff(2),
		handler: func(_ context.Context, _ *saga.StepRun, o *ord, p string) error {
			handlers.add(o.ID)
			handlers.note(o.ID, fmt.Sprint(len(p)))
			return nil
		},
		// Only the "copy" saga copies its payload (with a NUL) into the state.
		gotOf: func(o *ord, p string) string {
			if o.ID == "copy" {
				return p
			}
			return fmt.Sprint(len(p))
		},
		act: func(ctx context.Context, run *saga.StepRun, o *ord) error {
			n := acts.add(o.ID)
			switch o.ID {
			case "actnul":
				o.Note = "x\x00y"
			case "actbig":
				o.Note = testkit.RandomLetters(20_000) // past MaxStateBytes
			case "acterr":
				if n == 1 {
					return steps.WithCode("c\x00d\xff", errors.New(evil))
				}
			}
			return r.fx.Record(ctx, run, "act")
		},
	})
	// RescueInterval 1 s: a wake-up claimed in the moment before
	// ResumeType is written back held after the release looked, and only
	// the rescuer's next run releases it (documented under "Pause").
	r.start(t, func(c *saga.Config) {
		c.Workers = 1
		c.BatchSize = 16
		c.RescueInterval = time.Second
		c.MaxStateBytes = 16 << 10
	}, def)
	ctx := context.Background()

	payloads := map[string]any{
		"good-0": "fine", "good-1": "fine", "good-2": "fine", "good-3": "fine",
		"big":     evil,     // json.Marshal: each NUL as \u0000, each invalid byte as U+FFFD
		"copy":    "a\x00b", // json.Marshal escapes it: \u0000, accepted, refused by jsonb once in the state
		"escaped": json.RawMessage(`"\u0000"`),
		"actnul":  "fine",
		"actbig":  "fine",
		"acterr":  "fine",
	}
	ids := map[string]uuid.UUID{}
	for name := range payloads {
		ids[name] = r.startAt(t, def, name, "await")
	}
	// Hold the type so that every wake-up is released at once, for one
	// batch of the one worker.
	_, err := r.engine.PauseType(ctx, "hostile", "line them up")
	require.NoError(t, err)
	for name, p := range payloads {
		res, err := r.engine.Signal(ctx, saga.Signal{SagaID: ids[name], Name: "go", ID: "sig-" + name, Payload: p})
		require.NoError(t, err, name)
		require.False(t, res.Duplicate)
	}
	_, err = r.engine.ResumeType(ctx, "hostile")
	require.NoError(t, err)

	ended := map[string]*saga.Instance{}
	for name, id := range ids {
		ended[name] = r.ended(t, id)
	}
	for _, name := range []string{"good-0", "good-1", "good-2", "good-3", "big", "escaped", "acterr"} {
		in := ended[name]
		require.Equal(t, saga.StatusCompleted, in.Status, "%s\n%s", name, describe(in))
		require.Equal(t, []string{"prep", "onsig", "act"}, r.fx.List(t, in.ID), name)
		require.Equal(t, 1, count(in, "signal_received:await"), name)
		requireDelivered(t, r, in.ID, "await")
	}
	// The 10 kB payload arrived as JSON carries it: 9,800 letters, 100
	// NULs and 100 U+FFFD (3 bytes each).
	require.Equal(t, []string{"10200"}, handlers.notes("big"))
	// The error with NULs and invalid UTF-8 was stored, as storable text.
	var failed *saga.Event
	for i, e := range ended["acterr"].History {
		if e.Type == saga.EventStepFailed && e.Step == "act" {
			failed = &ended["acterr"].History[i]
		}
	}
	require.NotNil(t, failed, describe(ended["acterr"]))
	require.NotContains(t, failed.Error, "\x00")
	require.NotEmpty(t, failed.ErrorCode)
	require.Equal(t, 2, acts.get("acterr"))

	// copy: its handler put a NUL into the state; the await step fails
	// (its writes rolled back), the step after it never runs.
	in := ended["copy"]
	require.NotEqual(t, saga.StatusCompleted, in.Status, describe(in))
	require.NotNil(t, in.LastError, describe(in))
	require.Equal(t, "await", in.LastError.Step, describe(in))
	require.Zero(t, r.fx.Count(t, in.ID, "onsig"), describe(in))
	require.Zero(t, acts.get("copy"))

	// actnul: the chained step put a NUL into the state; it fails alone,
	// the wait's end (the handler's write, the signal's delivery) stays.
	in = ended["actnul"]
	require.NotEqual(t, saga.StatusCompleted, in.Status, describe(in))
	require.Equal(t, "act", in.LastError.Step, describe(in))
	require.Equal(t, 1, count(in, "step_completed:await"), describe(in))
	require.Zero(t, r.fx.Count(t, in.ID, "act"), describe(in))
	require.Equal(t, 1, r.fx.Count(t, in.ID, "onsig"), describe(in))
	requireDelivered(t, r, in.ID, "await")
	if in.Status == saga.StatusCompensated {
		require.Equal(t, []string{"prep", "onsig", "unawait", "unprep"}, r.fx.List(t, in.ID))
	}

	// actbig: the chained step grew the state past MaxStateBytes: the
	// same, with code payload_too_large.
	in = ended["actbig"]
	require.Equal(t, saga.StatusCompensated, in.Status, describe(in))
	require.Equal(t, "act", in.LastError.Step, describe(in))
	require.Equal(t, saga.CodeTooLarge, in.LastError.Code, describe(in))
	require.Equal(t, []string{"prep", "onsig", "unawait", "unprep"}, r.fx.List(t, in.ID))
	requireDelivered(t, r, in.ID, "await")
}
