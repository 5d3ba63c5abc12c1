package wire

import (
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// UUID is a saga id, a message id: 16 bytes, written in the canonical
// lowercase form xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx. Its underlying type
// is that of github.com/google/uuid's UUID, so the two convert into each
// other.
type UUID [16]byte

// String returns u in the canonical form.
func (u UUID) String() string {
	var b [36]byte
	hex.Encode(b[0:8], u[0:4])
	b[8] = '-'
	hex.Encode(b[9:13], u[4:6])
	b[13] = '-'
	hex.Encode(b[14:18], u[6:8])
	b[18] = '-'
	hex.Encode(b[19:23], u[8:10])
	b[23] = '-'
	hex.Encode(b[24:], u[10:])
	return string(b[:])
}

// IsZero reports whether u is the nil UUID, all zeros.
func (u UUID) IsZero() bool { return u == UUID{} }

// ParseUUID parses a UUID in the canonical form, in either case. It also
// takes the forms github.com/google/uuid takes ({…}, urn:uuid:…, 32 hex
// digits), so that it accepts what sagaflow accepted before; sagaflow
// itself only ever writes the canonical form.
func ParseUUID(s string) (UUID, error) {
	switch {
	case len(s) == 36+9 && strings.EqualFold(s[:9], "urn:uuid:"):
		s = s[9:]
	case len(s) == 36+2 && s[0] == '{' && s[37] == '}':
		s = s[1:37]
	}
	var u UUID
	switch len(s) {
	case 32:
		if _, err := hex.Decode(u[:], []byte(s)); err != nil {
			return UUID{}, fmt.Errorf("invalid UUID %q: not hexadecimal", s)
		}
		return u, nil
	case 36:
		if s[8] != '-' || s[13] != '-' || s[18] != '-' || s[23] != '-' {
			return UUID{}, fmt.Errorf("invalid UUID %q: want xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", s)
		}
		b := []byte(s[0:8] + s[9:13] + s[14:18] + s[19:23] + s[24:])
		if _, err := hex.Decode(u[:], b); err != nil {
			return UUID{}, fmt.Errorf("invalid UUID %q: not hexadecimal", s)
		}
		return u, nil
	}
	return UUID{}, fmt.Errorf("invalid UUID length %d: want 36 (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)", len(s))
}

// MarshalText writes u in the canonical form (a JSON string).
func (u UUID) MarshalText() ([]byte, error) { return []byte(u.String()), nil }

// UnmarshalText parses u with [ParseUUID].
func (u *UUID) UnmarshalText(b []byte) error {
	v, err := ParseUUID(string(b))
	if err != nil {
		return err
	}
	*u = v
	return nil
}

// Direction says whether a step runs its action or its compensation.
type Direction string

const (
	// Forward runs a step's action.
	Forward Direction = "forward"
	// Compensate runs a step's compensation.
	Compensate Direction = "compensate"
)

// Valid reports whether d is Forward or Compensate.
func (d Direction) Valid() bool { return d == Forward || d == Compensate }

// Key identifies one logical execution of one step of one saga: every
// attempt and every duplicate delivery of it shares the key. Its canonical
// form, written by [Key.String], is
//
//	<saga id>/<step name>/<direction>/<epoch>
//
// for example 0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e/charge/forward/0: the saga
// id in the canonical UUID form, the step name as the saga's definition
// names it (it contains no '/'), "forward" or "compensate", and the epoch
// in decimal without leading zeros. The key is written in Go only, by
// [Key.String]; sagaflow's SQL compares keys, never builds them.
type Key struct {
	SagaID    UUID
	Step      string
	Direction Direction
	Epoch     int
}

// String returns the key's canonical form.
func (k Key) String() string {
	return k.SagaID.String() + "/" + k.Step + "/" + string(k.Direction) + "/" + strconv.Itoa(k.Epoch)
}

// ParseKey parses a key written by [Key.String]. It checks the key's shape:
// four parts, a UUID, a step name as [ValidName] has it, a direction, a
// non-negative epoch in canonical decimal. A key that parses is storable
// text of at most a few hundred bytes.
func ParseKey(s string) (Key, error) {
	parts := strings.Split(s, "/")
	if len(parts) != 4 {
		return Key{}, fmt.Errorf("wire: parse key %q: want saga_id/step/direction/epoch", clip(s))
	}
	id, err := ParseUUID(parts[0])
	if err != nil {
		return Key{}, fmt.Errorf("wire: parse key %q: saga id: %w", clip(s), err)
	}
	if parts[1] == "" {
		return Key{}, fmt.Errorf("wire: parse key %q: empty step name", clip(s))
	}
	if !ValidName(parts[1]) {
		return Key{}, fmt.Errorf("wire: parse key %q: step name %q is not 1 to %d of letters, digits, '.', '-' and '_', as every step name is",
			clip(s), clip(parts[1]), MaxNameBytes)
	}
	dir := Direction(parts[2])
	if !dir.Valid() {
		return Key{}, fmt.Errorf("wire: parse key %q: direction %q is neither %q nor %q", clip(s), clip(parts[2]), Forward, Compensate)
	}
	epoch, err := strconv.Atoi(parts[3])
	if err != nil || epoch < 0 || strconv.Itoa(epoch) != parts[3] {
		return Key{}, fmt.Errorf("wire: parse key %q: epoch %q is not a non-negative decimal integer without sign or leading zeros", clip(s), clip(parts[3]))
	}
	return Key{SagaID: id, Step: parts[1], Direction: dir, Epoch: epoch}, nil
}

// Limits of the text fields of the protocol.
const (
	// MaxNameBytes bounds a saga's or a step's name: sagaflow's
	// definitions take 1 to 64 of a-z, A-Z, 0-9, '.', '-' and '_'.
	MaxNameBytes = 64
	// MaxKeyBytes bounds a step key, a message id, a topic or any other
	// header sagaflow stores in an indexed column.
	MaxKeyBytes = 512
)

// ErrInvalidText is wrapped by the errors of [CheckText].
var ErrInvalidText = errors.New("not storable text")

// CheckText returns an error naming field when s cannot be stored as it is
// in a PostgreSQL text column of at most limit bytes (limit <= 0: no
// limit): it holds a NUL byte, is not valid UTF-8, or is too long.
func CheckText(field, s string, limit int) error {
	if p := TextProblem(s, limit); p != "" {
		return fmt.Errorf("%s %s: %w", field, p, ErrInvalidText)
	}
	return nil
}

// TextProblem describes why s cannot be stored as it is in a PostgreSQL
// text column of at most limit bytes (limit <= 0: no limit), e.g. "contains
// a NUL byte", or returns "" when it can. It is sagaflow's one rule for text
// from outside the process.
func TextProblem(s string, limit int) string {
	switch {
	case strings.IndexByte(s, 0) >= 0:
		return "contains a NUL byte"
	case !utf8.ValidString(s):
		return "is not valid UTF-8"
	case limit > 0 && len(s) > limit:
		return fmt.Sprintf("is %d bytes, more than %d", len(s), limit)
	}
	return ""
}

// ValidName reports whether s can name a saga or a step: 1 to MaxNameBytes
// of a-z, A-Z, 0-9, '.', '-' and '_'. Definitions are held to it, so a step
// key or a command naming anything else comes from no sagaflow engine.
func ValidName(s string) bool {
	if s == "" || len(s) > MaxNameBytes {
		return false
	}
	for _, r := range s {
		if !(r == '.' || r == '-' || r == '_' || ('a' <= r && r <= 'z') || ('A' <= r && r <= 'Z') || ('0' <= r && r <= '9')) {
			return false
		}
	}
	return true
}
