package relay

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
)

func TestHoldBack(t *testing.T) {
	t.Parallel()
	rows := func(keys ...string) []store.RelayMessage {
		out := make([]store.RelayMessage, len(keys))
		for i, k := range keys {
			out[i].AggregateID = k
		}
		return out
	}
	set := func(keys ...string) map[string]struct{} {
		out := map[string]struct{}{}
		for _, k := range keys {
			out[k] = struct{}{}
		}
		return out
	}
	for _, tc := range []struct {
		name        string
		rows        []store.RelayMessage
		unpublished map[string]struct{}
		want        []bool
	}{
		{"no batch before", rows("a", "b"), nil, nil},
		{"everything published before", rows("a", "b"), set(), nil},
		{"other keys only", rows("a", "b"), set("c"), nil},
		{"every message of a key", rows("a", "b", "a", "c"), set("a"), []bool{true, false, true, false}},
		{"several keys", rows("a", "b", "c"), set("c", "a"), []bool{true, false, true}},
		{"the empty key, which keyless messages share", rows("", "a", ""), set(""), []bool{true, false, true}},
		{"an empty batch", rows(), set("a"), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tc.want, holdBack(tc.rows, tc.unpublished))
		})
	}
}
