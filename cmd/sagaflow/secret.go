package main

import (
	"encoding/json"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/sagaflow/sagaflow/internal/safetext"
)

// The CLI never prints a connection string. Errors about one say where it
// came from and what is wrong with it; errors from connecting name the
// user, host and database. pgx's texts can still carry a password: its
// redaction of a connection string that does not parse is best effort
// (it misses "password = pw" and more), and a password with an unencoded
// '@' ends partly in the host name, which every dial error repeats. So
// every error message is also passed through [secrets.redact], which
// withholds a message that holds any password the CLI can find in its
// arguments and environment, in any spelling a message can hold, or a
// piece a misparse can cut it into.

// minPiece is the shortest piece of a password that is looked for on its
// own. A whole password is always looked for, however short.
const minPiece = 3

// pieceSeparators are where a parser can cut a password into pieces that
// each end up elsewhere: URL and keyword/value delimiters, and blanks.
const pieceSeparators = "@:/?#&=,;'\"\\% \t\r\n\v\f"

// passwordKey finds a keyword/value password setting: "password=",
// "password = ", "sslpassword=".
var passwordKey = regexp.MustCompile(`(?i)password\s*=\s*`)

// secrets are the strings that must never be printed.
type secrets struct {
	list []string
}

// addDSN adds the passwords that a connection string s, or an argument
// that holds one, may carry: in a URL's user information (read up to each
// '@', as parsers disagree on which one ends it), in its query, and in
// keyword/value settings, with quotes and escapes as written and undone.
// It finds nothing in a string that holds no password.
func (s *secrets) addDSN(dsn string) {
	isURL := false
	if i := strings.Index(dsn, "://"); i >= 0 {
		isURL = true
		rest := dsn[i+3:]
		for at := range len(rest) {
			if rest[at] != '@' {
				continue
			}
			if _, pw, ok := strings.Cut(rest[:at], ":"); ok {
				s.addEncoded(pw)
			}
		}
		if _, query, ok := strings.Cut(rest, "?"); ok {
			for pair := range strings.SplitSeq(query, "&") {
				k, v, _ := strings.Cut(pair, "=")
				if dk, err := url.QueryUnescape(k); err == nil {
					k = dk
				}
				if strings.Contains(strings.ToLower(k), "password") {
					s.addEncoded(v)
				}
			}
		}
	}
	for _, loc := range passwordKey.FindAllStringIndex(dsn, -1) {
		raw, value := keywordValue(dsn[loc[1]:], isURL)
		s.add(raw)
		s.add(value)
	}
}

// keywordValue reads the value at the start of v as libpq does: quoted
// with backslash escapes, or up to a blank (or, in a URL, an '&'). It
// returns the value as written and with quotes and escapes undone. An
// unterminated quote runs to the end.
func keywordValue(v string, isURL bool) (raw, value string) {
	var b strings.Builder
	if strings.HasPrefix(v, "'") {
		i := 1
		for ; i < len(v) && v[i] != '\''; i++ {
			if v[i] == '\\' && i+1 < len(v) {
				i++
			}
			b.WriteByte(v[i])
		}
		return v[1:min(i, len(v))], b.String()
	}
	end := strings.IndexFunc(v, func(r rune) bool {
		return strings.ContainsRune(" \t\r\n\v\f", r) || isURL && r == '&'
	})
	if end < 0 {
		end = len(v)
	}
	for i := 0; i < end; i++ {
		if v[i] == '\\' && i+1 < end {
			i++
		}
		b.WriteByte(v[i])
	}
	return v[:end], b.String()
}

// addEncoded adds a URL component as written and percent-decoded.
func (s *secrets) addEncoded(pw string) {
	s.add(pw)
	if d, err := url.PathUnescape(pw); err == nil {
		s.add(d)
	}
	if d, err := url.QueryUnescape(pw); err == nil {
		s.add(d)
	}
}

// add adds the password pw in the spellings a message can hold (as is,
// quoted by %q, escaped for JSON, URL-encoded, escaped for a terminal)
// and the pieces it can be cut into.
func (s *secrets) add(pw string) {
	if pw == "" {
		return
	}
	quoted := strconv.Quote(pw)
	js, _ := json.Marshal(pw)
	forms := []string{pw, quoted[1 : len(quoted)-1], string(js[1 : len(js)-1]), url.QueryEscape(pw),
		url.PathEscape(pw), safetext.Escape(pw)}
	for piece := range strings.FieldsFuncSeq(pw, func(r rune) bool { return strings.ContainsRune(pieceSeparators, r) }) {
		if len(piece) >= minPiece {
			forms = append(forms, piece)
		}
	}
	for _, f := range forms {
		if f != "" && !slices.Contains(s.list, f) {
			s.list = append(s.list, f)
		}
	}
}

// withheld replaces a message that holds a secret. Masking the secret in
// place would show where it occurs, and so what it is: "xxxxx.0.0.1" gives
// away a password of 127, "xxxxxgres" one of post.
const withheld = "the error's text is withheld: it contained the database password, or part of it"

// redact returns msg, or [withheld] when msg holds any of the secrets in any
// spelling.
func (s *secrets) redact(msg string) string {
	for _, sec := range s.list {
		if strings.Contains(msg, sec) {
			return withheld
		}
	}
	return msg
}
