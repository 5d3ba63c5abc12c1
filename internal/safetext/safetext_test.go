package safetext

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

func TestText(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, in string
		limit    int
		want     string
	}{
		{"safe", "hello", 10, "hello"},
		{"nul", "a\x00b", 0, `a\0b`},
		{"invalid utf8", "a\xffb", 0, "a\uFFFDb"},
		{"cut on a rune", "ééé", 5, "é…"},
		{"the ellipsis counts", "ééé", 4, "…"},
		{"no limit", strings.Repeat("x", 10000), 0, strings.Repeat("x", 10000)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := Text(c.in, c.limit)
			require.Equal(t, c.want, got)
			require.Empty(t, Problem(got, 0))
		})
	}
}

func TestKey(t *testing.T) {
	t.Parallel()
	require.Equal(t, "order-1", Key("order-1"))
	long := strings.Repeat("k", 10_000)
	for _, in := range []string{"a\x00b", "a\xffb", long, "sha256:forged"} {
		got := Key(in)
		require.True(t, strings.HasPrefix(got, "sha256:"), in)
		require.Len(t, got, len("sha256:")+64)
		require.Empty(t, Problem(got, MaxKeyBytes))
	}
	// Distinct inputs stay distinct, also where the sanitised text would
	// not: the NUL and the two characters \0.
	require.NotEqual(t, Key("a\x00b"), Key(`a\0b`))
	require.NotEqual(t, Key(long), Key(long+"k"))
	// A caller cannot make a plain key collide with a hashed one.
	require.NotEqual(t, Key("a\x00b"), Key(Key("a\x00b")))
}

func TestHeadersKeepsCollidingNames(t *testing.T) {
	t.Parallel()
	h := Headers(map[string]string{"a\x00": "1", `a\0`: "2", "v": "x\xff"}, 100)
	require.Len(t, h, 3)
	for k, v := range h {
		require.True(t, utf8.ValidString(k) && utf8.ValidString(v))
		require.NotContains(t, k+v, "\x00")
	}
}

func TestEscape(t *testing.T) {
	t.Parallel()
	require.Equal(t, `plain é`, Escape("plain é"))
	require.Equal(t, `\u001b[2J\u0007\xff`, Escape("\x1b[2J\x07\xff"))
	require.Equal(t, `a\nb\u202e`, Escape("a\nb\u202e"))
	require.Equal(t, `\u0000`, Escape("\x00"))
}

func TestCheckNamesTheField(t *testing.T) {
	t.Parallel()
	require.NoError(t, Check("step key", "ok", 10))
	require.EqualError(t, Check("step key", "a\x00", 10), "step key contains a NUL byte")
	require.EqualError(t, Check("header name", strings.Repeat("x", 11), 10), "header name is 11 bytes, more than 10")
}

func TestJSONHasNUL(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]bool{
		`{"a":"x\u0000y"}`:     true,
		`"\u0000"`:             true,
		`{"a":"\\\u0000"}`:     true,  // an escaped backslash, then a NUL
		`{"a":"C:\\u0000dir"}`: false, // the six characters \u0000
		`{"a":"\\\\u0000"}`:    false,
		`{"a":"\u00001"}`:      true,
		`{"a":"\u0001"}`:       false,
		`{"a":"x"}`:            false,
		`\`:                    false,
	} {
		require.Equal(t, want, JSONHasNUL([]byte(in)), in)
	}
}
