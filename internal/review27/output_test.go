package review27_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// evil is stored text an attacker controls (a business key from a web
// form, a provider's error message): a screen clear, colour, a cursor move,
// an OSC 8 hyperlink and an OSC title, a bell, a carriage return that
// rewrites the line, a backspace, the 8-bit CSI (U+009B), the right-to-left
// override, a bidi isolate, and the line and paragraph separators.
const evil = "A\x1b[2J\x1b[31mRED\x1b[0m\x1b[1;1H" +
	"\x1b]8;;https://evil.example/\x1b\\link\x1b]8;;\x1b\\" +
	"\x1b]0;pwned\x07\rOVERWRITE\bB\u009b31m\u202egnp.exe\u2066iso\u2069\u2028LS\u2029PS-Z"

// forbidden reports the first character of s a terminal would act on:
// control characters (C0, DEL, C1), bidirectional overrides, embeddings and
// isolates, and line/paragraph separators. Newlines and tabs the CLI writes
// itself are allowed.
func forbidden(s string) (rune, bool) {
	for _, r := range s {
		switch {
		case r == '\n' || r == '\t':
		case r == utf8.RuneError:
			return r, true
		case unicode.IsControl(r):
			return r, true
		case r >= 0x202a && r <= 0x202e, r >= 0x2066 && r <= 0x2069, r == 0x2028, r == 0x2029:
			return r, true
		}
	}
	return 0, false
}

// `go doc ./cmd/sagaflow`: "The human output writes its control characters,
// bidirectional overrides, line separators and invalid UTF-8 as Go escapes
// (\u001b, \u202e, \xff), so that it cannot move the cursor, rewrite the
// screen or reorder what an operator reads; error texts are first folded
// onto one line. The --json output escapes the same characters as JSON \u
// escapes and decodes to the stored text."
func TestHostileStoredTextNeverReachesTheTerminal(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := testkit.NewDB(t)
	fx := testkit.NewEffects(t, d)

	// A failed saga whose business key, error and error code are evil.
	p := newPay("r27pay")
	p.errMsg, p.errCode = "declined: "+evil, "code-"+evil
	fids := failed(t, d, p, 1, func(int) string { return "key-" + evil })
	// A waiting saga with evil state, signals (id, payload, a rejected
	// one) and an evil pause reason.
	wdef := newWait("r27wait", fx)
	wids := waiting(t, d, wdef, 1, func(int) string { return "wait-" + evil })
	e := testkit.NewEngine(t, d.Pool, d.Config(), wdef)
	if _, err := e.Signal(ctx, saga.Signal{SagaID: wids[0], Name: "other", ID: "sig-" + evil, Payload: map[string]string{"bin": evil}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Signal(ctx, saga.Signal{SagaID: fids[0], Name: "picked", ID: "rej-" + evil}); err == nil {
		t.Fatal("a signal to a failed saga was not rejected")
	}
	if err := e.Pause(ctx, wids[0], "pause-"+evil); err != nil {
		t.Fatal(err)
	}
	if _, err := e.PauseType(ctx, "r27pay", "type-"+evil); err != nil {
		t.Fatal(err)
	}
	// A cancel reason an operator typed (recorded by the CLI itself).
	want(t, cli(t, d, "cancel", wids[0].String(), "--reason", "cancel-"+evil), 0)
	// Dead outbox message and dead letter with evil texts.
	outboxRow(t, d, "orders", "key-"+evil, "dead", "dead-"+evil)
	deadLetter(t, d, "consumer-"+evil, "orders", "msg-"+evil, "reason-"+evil)

	runs := [][]string{
		{"list"},
		{"list", "--status", "failed", "--failed-step", "charge"},
		{"list", "--business-key", "key-" + evil},
		{"list", "--waiting"},
		{"list", "--paused"},
		{"show", fids[0].String()},
		{"show", wids[0].String()},
		{"versions"},
		{"dead", "list"},
		{"dead", "list", "--kind", "letters", "--consumer", "consumer-" + evil},
		{"outbox", "status"},
		{"replay", "--bulk", "--dry-run", "--name", "r27pay"},
		{"replay", fids[0].String(), "--plan"},
		{"replay", fids[0].String(), "--from-step", "open", "--plan"},
		{"cancel", wids[0].String(), "--plan"},
		{"signal", wids[0].String(), "other", "--id", "sig-" + evil},
		{"list", "--name", "r27\x1b[2Jpay"},
		{"show", "\x1b[2J" + fids[0].String()},
		{"replay", "--bulk", "--error-code", evil, "--dry-run"},
		{"list", "--business-key", evil + strings.Repeat("k", 600)},
	}
	var leaks []string
	for i, args := range runs {
		r := cli(t, d, args...)
		for _, out := range []struct{ name, s string }{{"stdout", r.stdout}, {"stderr", r.stderr}} {
			if c, bad := forbidden(out.s); bad {
				leaks = append(leaks, fmt.Sprintf("%q: %s holds %U raw:\n%s", shortArgs(args), out.name, c, out.s))
			}
		}
		if r.code != 0 {
			// Errors are folded onto one line.
			if lines := strings.Count(strings.TrimRight(r.stderr, "\n"), "\n"); lines > 0 && !strings.Contains(r.stderr, "Usage") {
				leaks = append(leaks, fmt.Sprintf("%q: the error spans %d lines:\n%s", shortArgs(args), lines+1, r.stderr))
			}
		}
		// --json: one valid document, no raw escapes, decoding to the text.
		if i%2 == 1 && i > 8 {
			continue
		}
		rj := cli(t, d, append(args, "--json")...)
		if c, bad := forbidden(rj.stdout + rj.stderr); bad {
			leaks = append(leaks, fmt.Sprintf("%q --json: output holds %U raw:\n%s", shortArgs(args), c, rj.stdout))
		}
		jsonDoc(t, rj)
	}
	// The stored text is what the human output shows, escaped: the business
	// key's visible parts are there.
	sr := cli(t, d, "show", fids[0].String())
	if !strings.Contains(sr.stdout, "gnp.exe") || !strings.Contains(sr.stdout, "OVERWRITE") {
		t.Errorf("show does not print the escaped business key or error:\n%s", sr.stdout)
	}
	// --json decodes to the stored text.
	sj := cli(t, d, "show", fids[0].String(), "--json")
	want(t, sj, 0)
	var doc struct {
		BusinessKey string `json:"business_key"`
		LastError   *struct {
			Code    string `json:"code"`
			Message string `json:"message"`
		} `json:"last_error"`
	}
	if err := json.Unmarshal([]byte(sj.stdout), &doc); err != nil {
		t.Fatal(err)
	}
	in := get(t, client(t, d), fids[0])
	if doc.BusinessKey != in.BusinessKey || doc.LastError == nil || doc.LastError.Message != in.LastError.Message || doc.LastError.Code != in.LastError.Code {
		t.Errorf("show --json does not decode to the stored text:\njson   %q / %+v\nstored %q / %+v", doc.BusinessKey, doc.LastError, in.BusinessKey, in.LastError)
	}
	if len(leaks) > 0 {
		t.Logf("%d leaks:\n%s", len(leaks), strings.Join(leaks, "\n\n"))
		t.Fatalf("%d outputs hold characters the docs say are escaped", len(leaks))
	}
}

func shortArgs(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = short(a)
	}
	return out
}

// An id of the other kind in show: a saga id that is a valid UUID of a
// signal, a dead message or nothing is "not found" (3), JSON {"error","code"}.
func TestShowNotFoundVariants(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	msg := outboxRow(t, d, "orders", "k", "dead", "x")
	for _, id := range []string{msg.String(), uuid.Nil.String(), "FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF", "urn:uuid:" + uuid.NewString(), "{" + uuid.NewString() + "}"} {
		r := cli(t, d, "show", id)
		if r.code != 3 && r.code != 2 {
			t.Fatalf("show %s:\n%s", id, r)
		}
		if r.code == 3 {
			jsonErr(t, cli(t, d, "show", id, "--json"), 3)
		}
	}
}
