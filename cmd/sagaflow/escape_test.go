package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// hostile is stored data that would act on a terminal: it sets the window
// title (ESC ] … BEL), clears the screen, returns the carriage, reverses
// the text that follows (U+202E), starts a C1 control sequence (U+009B),
// and holds DEL and a line separator. PostgreSQL stores all of it; only
// NUL and invalid UTF-8 it refuses (see TestTerminalSafeJSON for those).
const hostile = "k\x1b]0;pwned\x07\x1b[2J\rfake\u202eevil\u009b31m\x7f\u2028end"

// requireTerminalSafe requires that out holds nothing a terminal acts on:
// no control character other than newline, and no bidirectional override,
// C1 control or line separator.
func requireTerminalSafe(t *testing.T, what, out string) {
	t.Helper()
	for i, r := range out {
		unsafe := r < 0x20 && r != '\n' || r == 0x7f || r >= 0x80 && r < 0xa0 || r == 0x2028 || r == 0x2029 ||
			r >= 0x202a && r <= 0x202e || r >= 0x2066 && r <= 0x2069 || r == 0x200e || r == 0x200f
		require.False(t, unsafe, "%s: %U at byte %d of:\n%s", what, r, i, out)
	}
}

// TestStoredTextIsEscaped stores hostile text in every text column of a
// saga and its history that a command prints, and runs each command that
// prints them: the human output is escaped, and the JSON output is escaped
// and still decodes to the stored text.
func TestStoredTextIsEscaped(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	e, orderDef, _ := f.engine(t, false)
	st, err := saga.Start(ctx, e, orderDef, order{ID: hostile}, &saga.StartOpts{BusinessKey: hostile})
	require.NoError(t, err)
	id := st.ID
	// A second saga that failed, with hostile text where the library
	// writes a handler's error, its code, the step and its history.
	failed, err := saga.Start(ctx, e, orderDef, order{ID: "o-2"}, nil)
	require.NoError(t, err)
	_, err = f.Pool.Exec(ctx, `UPDATE `+f.Table("saga_instances")+`
		SET saga_name = $2, step_name = $2, last_error = $2, last_error_code = $2, failed_step = $2,
		    status = 'failed', ended_at = now(), parent_id = $3
		WHERE id = $1`, failed.ID, hostile, id)
	require.NoError(t, err)
	_, err = f.Pool.Exec(ctx, `INSERT INTO `+f.Table("saga_history")+`
		(saga_id, event, step_name, direction, epoch, attempt, error, error_code, detail)
		VALUES ($1, $2, $2, 'forward', 0, 1, $2, $2, jsonb_build_object('reason', $2::text))`, failed.ID, hostile)
	require.NoError(t, err)

	// A running saga that waits for a hostile signal name, and got one
	// with a hostile id; a rejected one is recorded for the failed saga.
	_, err = f.Pool.Exec(ctx, `UPDATE `+f.Table("saga_instances")+`
		SET wait_kind = 'signal', wait_for = $2, wait_until = now() + interval '1 hour' WHERE id = $1`, id, hostile)
	require.NoError(t, err)
	_, err = e.Signal(ctx, saga.Signal{SagaID: id, Name: hostile, ID: hostile})
	require.NoError(t, err)
	_, err = e.Signal(ctx, saga.Signal{SagaID: failed.ID, Name: hostile, ID: hostile})
	require.ErrorIs(t, err, saga.ErrSignalRejected)

	runs := map[string][]string{
		"list --waiting":            {"list", "--waiting"},
		"signal":                    {"signal", id.String(), hostile, "--id", hostile, "--payload", `"` + hostile + `"`},
		"signal rejected":           {"signal", failed.ID.String(), hostile, "--id", hostile},
		"signal by key":             {"signal", "--saga", hostile, "--key", hostile, hostile},
		"signal bad payload":        {"signal", id.String(), "s", "--payload", hostile},
		"list":                      {"list"},
		"list --name":               {"list", "--name", hostile},
		"show":                      {"show", id.String()},
		"show failed":               {"show", failed.ID.String()},
		"replay from a step":        {"replay", failed.ID.String(), "--from-step", "nope"},
		"replay running":            {"replay", id.String()},
		"replay --bulk":             {"replay", "--bulk", "--from-step", "nope", "--rate", "1000"},
		"replay --bulk --dry-run":   {"replay", "--bulk", "--dry-run", "--from-step", hostile},
		"replay --from-step echoed": {"replay", failed.ID.String(), "--from-step", hostile + "?"},
		"cancel":                    {"cancel", id.String(), "--reason", hostile},
		"unknown command":           {hostile},
		"bad id":                    {"show", hostile},
	}
	for name, args := range runs {
		for _, js := range []bool{false, true} {
			if js {
				args = append(args, "--json")
				name += " --json"
			}
			r := f.cli(t, args...)
			requireTerminalSafe(t, name+": stdout", r.stdout)
			requireTerminalSafe(t, name+": stderr", r.stderr)
			if js && r.stdout != "" {
				require.True(t, json.Valid([]byte(r.stdout)), "%s: %s", name, r.stdout)
			}
		}
	}

	// The escapes are visible, and nothing is lost.
	out := f.cli(t, "show", failed.ID.String()).ok(t)
	esc := `k\u001b]0;pwned\u0007\u001b[2J\rfake\u202eevil\u009b31m\u007f\u2028end`
	// Error texts are folded onto one line first: CR and U+2028 are blanks.
	escErr := `k\u001b]0;pwned\u0007\u001b[2J fake\u202eevil\u009b31m\u007f end`
	requireInOrder(t, out, "name:", esc, "step:", esc, "last error:", escErr+" ("+escErr+") at step "+esc,
		"timeline", esc, esc, escErr+" ("+escErr+")", `{"reason":"`+esc+`"}`)
	out = f.cli(t, "show", id.String()).ok(t)
	requireInOrder(t, out, "business key:  "+esc, "waits for:     signal:"+escErr+" until ",
		"signals (", esc, "id "+esc, "pending")
	require.Contains(t, f.cli(t, "list", "--waiting").ok(t), "signal:"+escErr+" until ")
	out = f.cli(t, "show", failed.ID.String()).ok(t)
	requireInOrder(t, out, "parent:        "+id.String(), "signals (1):", esc, "id "+esc, "rejected", "signal rejected")
	require.Equal(t, id, *decode[saga.Instance](t, f.cli(t, "show", failed.ID.String(), "--json")).ParentID)
	sh := decode[showDoc](t, f.cli(t, "show", id.String(), "--json"))
	require.Equal(t, hostile, sh.Wait.For)
	require.Equal(t, hostile, sh.Signals[0].Name)
	require.Equal(t, hostile, sh.Signals[0].ID)
	require.Contains(t, f.cli(t, "list").ok(t), esc)
	r := f.cli(t, "replay", "--bulk", "--from-step", "nope", "--rate", "1000")
	require.Equal(t, exitFailed, r.code)
	require.Contains(t, r.stdout, "(steps in its history: [reserve "+escErr+"])")

	in := decode[saga.Instance](t, f.cli(t, "show", failed.ID.String(), "--json"))
	require.Equal(t, hostile, in.Name)
	require.Equal(t, hostile, in.Step)
	require.Equal(t, hostile, in.LastError.Message)
	require.Equal(t, hostile, in.LastError.Code)
	last := in.History[len(in.History)-1]
	require.Equal(t, hostile, last.Type)
	require.Equal(t, hostile, last.Error)
	require.JSONEq(t, `{"reason":`+string(must(json.Marshal(hostile)))+`}`, string(last.Detail))
	in = decode[saga.Instance](t, f.cli(t, "show", id.String(), "--json"))
	require.Equal(t, hostile, in.BusinessKey)
	var o order
	require.NoError(t, in.DecodeState(&o))
	require.Equal(t, hostile, o.ID)
	list := decode[struct{ Sagas []saga.Instance }](t, f.cli(t, "list", "--json"))
	require.Len(t, list.Sagas, 2)
	for _, s := range list.Sagas {
		require.Contains(t, []string{hostile, "order"}, s.Name)
	}
	require.Contains(t, []uuid.UUID{list.Sagas[0].ID, list.Sagas[1].ID}, failed.ID)
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestTerminalSafeJSON covers what PostgreSQL cannot store but a library
// error or json.RawMessage can carry: invalid UTF-8 and NUL.
func TestTerminalSafeJSON(t *testing.T) {
	t.Parallel()
	doc := struct {
		S   string          `json:"s"`
		Raw json.RawMessage `json:"raw"`
	}{S: hostile + "\xff\x00", Raw: json.RawMessage("\"r\x7f\xc2\x9b\u202e\xfe\"")}
	var b strings.Builder
	require.NoError(t, writeJSON(&b, doc))
	requireTerminalSafe(t, "json", b.String())
	require.NotContains(t, b.String(), "\xff")
	require.NotContains(t, b.String(), "\xfe")
	var back struct{ S, Raw string }
	require.NoError(t, json.Unmarshal([]byte(b.String()), &back))
	require.Equal(t, strings.ToValidUTF8(hostile+"\xff\x00", "\uFFFD"), back.S)
	require.Equal(t, "r\x7f\u009b\u202e\uFFFD", back.Raw)
	require.Equal(t, "{\n  \"a\": 1\n}\n", string(terminalSafeJSON([]byte("{\n  \"a\": 1\n}\n"))), "layout is kept")

	require.Equal(t, `a\xffb`, cell("a\xffb"))
	require.Equal(t, "-", cell(""))
	require.Equal(t, `a b \u001b[2J\xfe`, oneLine("a\tb\n\x1b[2J\xfe", 100))
	require.Equal(t, `"x\u007f"`, compactJSON([]byte("\"x\x7f\"")))
	require.Equal(t, `not json \u001b`, indentJSON([]byte("not json \x1b")))
}
