// Package safetext is sagaflow's one rule for untrusted strings: every string
// that comes from a message, a handler or a caller passes through it before
// it reaches a PostgreSQL text, jsonb or indexed column.
//
// PostgreSQL refuses a NUL byte in text and jsonb (SQLSTATE 22021 and
// 22P05), refuses invalid UTF-8 in a UTF8 database (22021), and refuses a
// btree index entry larger than about 2.7 kB (54000). Each of those errors
// repeats on every retry, so a value that carries one must be made safe, or
// refused with an error naming the field, before it is written.
package safetext

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/sagaflow/sagaflow/wire"
)

// MaxKeyBytes bounds a string stored in an indexed column (an inbox key, a
// message id, a business key) as it is. A longer or unsafe key is stored as
// its hash (see [Key]). Well below the btree limit, with room for the rest
// of a composite key.
const MaxKeyBytes = wire.MaxKeyBytes

// hashPrefix starts a key that [Key] replaced by its hash.
const hashPrefix = "sha256:"

// Problem describes why s cannot be stored as it is in a text column of at
// most limit bytes (limit <= 0: no limit), or returns "" when it can.
func Problem(s string, limit int) string { return wire.TextProblem(s, limit) }

// Check returns an error naming field when s cannot be stored as it is in
// a text column of at most limit bytes (limit <= 0: no limit).
func Check(field, s string, limit int) error {
	if p := Problem(s, limit); p != "" {
		return fmt.Errorf("%s %s", field, p)
	}
	return nil
}

// ellipsis ends a cut text.
const ellipsis = "…"

// Text makes s storable in a text or jsonb value: NUL bytes become the two
// characters \0, invalid UTF-8 becomes U+FFFD, and a string longer than
// limit bytes (limit <= 0: no limit) is cut on a rune boundary and ends
// with "…", at most limit bytes in all. A string that is already safe and short enough is returned as it
// is.
func Text(s string, limit int) string {
	if Problem(s, limit) == "" {
		return s
	}
	s = strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", `\0`), "\uFFFD")
	if limit > 0 && len(s) > limit {
		// The ellipsis counts: the result is at most limit bytes (or just
		// the ellipsis, for a limit shorter than it).
		cut := max(limit-len(ellipsis), 0)
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + ellipsis
	}
	return s
}

// Key returns a form of s that is safe in an indexed text column and still
// identifies s: s itself when it is valid UTF-8, has no NUL and is at most
// MaxKeyBytes long (and does not itself look like a hashed key), else
// "sha256:" and the hex SHA-256 of its bytes. Two different inputs never
// share a stored key unless SHA-256 collides.
func Key(s string) string {
	if Problem(s, MaxKeyBytes) == "" && !strings.HasPrefix(s, hashPrefix) {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return hashPrefix + hex.EncodeToString(sum[:])
}

// Headers returns a copy of h whose names and values are all storable
// (each as [Text] with limit), for a jsonb column. Two names that become
// the same keep the later one's value under the name with a "#n" suffix, so
// nothing is silently merged.
func Headers(h map[string]string, limit int) map[string]string {
	out := make(map[string]string, len(h))
	for k, v := range h {
		sk := Text(k, limit)
		for n := 2; ; n++ {
			if _, taken := out[sk]; !taken {
				break
			}
			sk = Text(k, limit) + fmt.Sprintf("#%d", n)
		}
		out[sk] = Text(v, limit)
	}
	return out
}

// Escape returns s with control characters and invalid UTF-8 written as Go
// escapes, for a terminal: stored data shown by a tool must not move the
// cursor, clear the screen or set a window title.
func Escape(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\r':
			b.WriteString(`\r`)
		case r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0):
			fmt.Fprintf(&b, `\u%04x`, r)
		case r == 0x2028 || r == 0x2029 || r == 0x200e || r == 0x200f || (r >= 0x202a && r <= 0x202e) || (r >= 0x2066 && r <= 0x2069):
			// Line separators and bidirectional overrides reorder what an
			// operator reads.
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return b.String()
}

// JSONHasNUL reports whether the JSON text b holds a NUL character (the
// escape \u0000, which PostgreSQL's jsonb refuses). A backslash that is
// itself escaped does not start one: the text `\u0000` (six characters)
// is stored as it is.
func JSONHasNUL(b []byte) bool {
	for i := 0; i < len(b); i++ {
		if b[i] != '\\' {
			continue
		}
		if bytes.HasPrefix(b[i+1:], []byte("u0000")) {
			return true
		}
		i++ // the escaped character
	}
	return false
}

// StateProblem says why a saga's encoded state, after step, cannot be
// stored ("" when it can): larger than maxBytes (tooLarge), or holding a
// NUL character, which PostgreSQL's jsonb refuses. The engine and the test
// kit's RunStep judge a step's state by it.
func StateProblem(step string, state []byte, maxBytes int) (problem string, tooLarge bool) {
	if len(state) > maxBytes {
		return fmt.Sprintf("state is %d bytes after step %q, more than MaxStateBytes (%d)", len(state), step, maxBytes), true
	}
	if JSONHasNUL(state) {
		return "state contains a NUL character (\\u0000), which PostgreSQL jsonb cannot store", false
	}
	return "", false
}
