package ui

import (
	"encoding/hex"
	"fmt"
	"html/template"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// funcs are the templates' helpers. html/template escapes what they return;
// they make the rest visible: control characters and invalid UTF-8 become
// escapes instead of reaching the page raw.
var funcs = template.FuncMap{
	"vis":      visible,
	"hexdump":  hexdump,
	"escaped":  escapedBytes,
	"time":     fmtTime,
	"timep":    fmtTimePtr,
	"iso":      func(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) },
	"offset":   offset,
	"dur":      fmtDuration,
	"link":     link,
	"add":      func(a, b int) int { return a + b },
	"vislines": visibleLines,
	"dict2": func(rows any, prefix, status string) map[string]any {
		return map[string]any{"Rows": rows, "Prefix": prefix, "Status": status}
	},
}

// visibleLines is [visible] for text of several lines: newlines and tabs
// stay.
func visibleLines(s string) string {
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		parts := strings.Split(l, "\t")
		for j, p := range parts {
			parts[j] = visible(p)
		}
		lines[i] = strings.Join(parts, "\t")
	}
	return strings.Join(lines, "\n")
}

// visible returns s with control characters (other than space) and invalid
// UTF-8 shown as Go escapes, so that nothing in a stored string can change
// how the page reads.
func visible(s string) string {
	clean := true
	for _, r := range s {
		if r == utf8.RuneError || unicode.IsControl(r) || r == '\u2028' || r == '\u2029' || unicode.Is(unicode.Bidi_Control, r) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for len(s) > 0 {
		r, n := utf8.DecodeRuneInString(s)
		switch {
		case r == utf8.RuneError && n <= 1:
			fmt.Fprintf(&b, `\x%02x`, s[0])
		case unicode.IsControl(r) || r == '\u2028' || r == '\u2029' || unicode.Is(unicode.Bidi_Control, r):
			q := strconv.QuoteRuneToASCII(r)
			b.WriteString(q[1 : len(q)-1])
		default:
			b.WriteString(s[:n])
		}
		s = s[n:]
	}
	return b.String()
}

// hexdump renders bytes as rows of 16 hex pairs with their offset.
func hexdump(p []byte) string {
	var b strings.Builder
	for off := 0; off < len(p); off += 16 {
		end := min(off+16, len(p))
		fmt.Fprintf(&b, "%04x  %-47s\n", off, strings.TrimSpace(spaced(hex.EncodeToString(p[off:end]))))
	}
	return b.String()
}

func spaced(h string) string {
	var b strings.Builder
	for i := 0; i < len(h); i += 2 {
		b.WriteString(h[i : i+2])
		b.WriteByte(' ')
	}
	return b.String()
}

// escapedBytes renders bytes as text with everything that is not printable
// ASCII or valid UTF-8 escaped, as Go quotes it, without the quotes.
func escapedBytes(p []byte) string {
	q := strconv.Quote(string(p))
	return q[1 : len(q)-1]
}

const timeLayout = "2006-01-02 15:04:05.000 MST"

func fmtTime(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format(timeLayout)
}

func fmtTimePtr(t *time.Time) string {
	if t == nil {
		return ""
	}
	return fmtTime(*t)
}

// offset is how long after start t is, as "+1.234s".
func offset(start, t time.Time) string { return "+" + fmtDuration(t.Sub(start)) }

func fmtDuration(d time.Duration) string {
	switch {
	case d < time.Millisecond:
		return d.String()
	case d < time.Minute:
		return d.Round(time.Millisecond).String()
	default:
		return d.Round(time.Second).String()
	}
}

// link joins path and the non-empty values of query, given as name, value
// pairs, into a URL.
func link(path string, kv ...string) string {
	q := url.Values{}
	for i := 0; i+1 < len(kv); i += 2 {
		if kv[i+1] != "" {
			q.Add(kv[i], kv[i+1])
		}
	}
	if len(q) == 0 {
		return path
	}
	return path + "?" + q.Encode()
}
