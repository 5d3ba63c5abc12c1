package sagatest

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestDiff(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name      string
		want, got []string
		diff      string
	}{
		{"equal", []string{"a", "b"}, []string{"a", "b"}, "    a\n    b"},
		{"both empty", nil, nil, ""},
		{"one changed", []string{"a", "b", "c"}, []string{"a", "x", "c"}, "    a\n  - b\n  + x\n    c"},
		{"one missing", []string{"a", "b", "c"}, []string{"a", "c"}, "    a\n  - b\n    c"},
		{"one more", []string{"a", "c"}, []string{"a", "b", "c"}, "    a\n  + b\n    c"},
		{"got empty", []string{"a"}, nil, "  - a"},
		{"want empty", nil, []string{"a"}, "  + a"},
		{"a retry more", []string{"s", "f:x", "c:x", "e"}, []string{"s", "f:x", "f:x", "c:x", "e"},
			"    s\n    f:x\n  + f:x\n    c:x\n    e"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, c.diff, diff(c.want, c.got))
		})
	}
}

func TestLiteral(t *testing.T) {
	t.Parallel()
	require.Equal(t, `[]string{}`, literal(nil))
	require.Equal(t, `[]string{"saga_started", "a\"b"}`, literal([]string{"saga_started", `a"b`}))
}
