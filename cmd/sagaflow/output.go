package main

import (
	"bytes"
	"encoding/json"
	"io"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/saga"
)

// writeJSON writes v as one indented JSON document, safe for a terminal
// (see [terminalSafeJSON]).
func writeJSON(w io.Writer, v any) error {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return err
	}
	_, err := w.Write(terminalSafeJSON(b.Bytes()))
	return err
}

// terminalSafeJSON writes as \u escapes the characters of a JSON document
// that encoding/json (and PostgreSQL's jsonb output) leave as they are but
// a terminal acts on: DEL, the C1 controls (U+009B is a CSI on some
// terminals), bidirectional overrides and line separators; and invalid
// UTF-8, which json.RawMessage passes through, as U+FFFD. Outside strings
// a JSON document is ASCII, so each of these is inside a string, where the
// escape decodes to the same text.
func terminalSafeJSON(doc []byte) []byte {
	var out bytes.Buffer
	start := 0
	for i := 0; i < len(doc); {
		r, size := utf8.DecodeRune(doc[i:])
		esc := ""
		switch {
		case r == utf8.RuneError && size == 1:
			esc = `\ufffd`
		case r >= 0x7f:
			// Below DEL, encoding/json has escaped what needs it, and a
			// newline outside a string is the document's own layout.
			if e := safetext.Escape(string(r)); e != string(r) {
				esc = e
			}
		}
		if esc != "" {
			out.Write(doc[start:i])
			out.WriteString(esc)
			start = i + size
		}
		i += size
	}
	if start == 0 {
		return doc
	}
	out.Write(doc[start:])
	return out.Bytes()
}

// table aligns tab-separated columns and writes them, without trailing
// blanks, on Flush.
type table struct {
	out io.Writer
	buf bytes.Buffer
	tw  *tabwriter.Writer
}

func newTable(w io.Writer) *table {
	t := &table{out: w}
	t.tw = tabwriter.NewWriter(&t.buf, 0, 0, 2, ' ', 0)
	return t
}

func (t *table) Write(p []byte) (int, error) { return t.tw.Write(p) }

// Flush writes the aligned rows.
func (t *table) Flush() error {
	if err := t.tw.Flush(); err != nil {
		return err
	}
	var out strings.Builder
	for line := range strings.Lines(t.buf.String()) {
		out.WriteString(strings.TrimRight(line, " \n") + "\n")
	}
	t.buf.Reset()
	_, err := io.WriteString(t.out, out.String())
	return err
}

// timeLayout is RFC 3339 with milliseconds, so a printed time can be pasted
// into a time flag.
const timeLayout = "2006-01-02T15:04:05.000Z07:00"

// formatTime prints t in UTC.
func formatTime(t time.Time) string {
	return t.UTC().Format(timeLayout)
}

// formatTimePtr prints t, or "-" when it is nil.
func formatTimePtr(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return formatTime(*t)
}

// formatWait prints what a saga waits for as "kind:for until time"
// ("signal:picked until 2026-01-02T15:04:05.000Z", "timer until …",
// "child:<id>"), escaped, or "-" when it does not wait.
func formatWait(w *saga.WaitInfo) string {
	if w == nil {
		return "-"
	}
	s := oneLine(w.Kind, errorWidth)
	if w.For != "" {
		s += ":" + oneLine(w.For, errorWidth)
	}
	if w.Until != nil {
		s += " until " + formatTime(*w.Until)
	}
	return orDash(s)
}

// formatOffset prints d as a signed offset rounded to a precision that suits
// its size: +512µs, +12.3ms, +1.234s, +2m3s.
func formatOffset(d time.Duration) string {
	sign := "+"
	if d < 0 {
		sign, d = "-", -d
	}
	switch {
	case d < time.Millisecond:
		d = d.Round(time.Microsecond)
	case d < time.Second:
		d = d.Round(100 * time.Microsecond)
	case d < time.Minute:
		d = d.Round(time.Millisecond)
	default:
		d = d.Round(time.Second)
	}
	return sign + d.String()
}

// formatAge prints a duration rounded to milliseconds, or "-" for zero.
func formatAge(d time.Duration) string {
	if d <= 0 {
		return "-"
	}
	return d.Round(time.Millisecond).String()
}

// oneLine folds s onto one line (tabs and newlines would break the
// columns), escapes what a terminal would act on, and cuts it after limit
// runes.
func oneLine(s string, limit int) string {
	s = safetext.Escape(strings.Join(strings.Fields(s), " "))
	if utf8.RuneCountInString(s) <= limit {
		return s
	}
	r := []rune(s)
	return string(r[:limit-1]) + "…"
}

// cell prints a stored string in a table column or after a label: escaped,
// so that it can neither act on the terminal nor break the columns, and
// "-" when it is empty.
func cell[S ~string](s S) string {
	return orDash(safetext.Escape(string(s)))
}

// withCode prints an error message with its code: "card declined (card_declined)".
// Both are folded and escaped (see [oneLine]).
func withCode(msg, code string, limit int) string {
	msg, code = oneLine(msg, limit), oneLine(code, limit)
	switch {
	case code == "":
		return msg
	case msg == "":
		return "(" + code + ")"
	}
	return msg + " (" + code + ")"
}

// orDash returns s, or "-" when it is empty.
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// indentJSON indents a JSON document for reading, safe for a terminal; it
// returns raw escaped when it is not valid JSON.
func indentJSON(raw []byte) string {
	var b bytes.Buffer
	if err := json.Indent(&b, raw, "", "  "); err != nil {
		return safetext.Escape(string(raw))
	}
	return string(terminalSafeJSON(b.Bytes()))
}

// compactJSON prints a JSON document on one line, safe for a terminal; it
// returns raw escaped when it is not valid JSON.
func compactJSON(raw []byte) string {
	var b bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		return safetext.Escape(string(raw))
	}
	return string(terminalSafeJSON(b.Bytes()))
}
