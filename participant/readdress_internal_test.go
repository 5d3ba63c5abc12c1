package participant

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/wire"
)

// A reply sent again for a step that ran before answers the command that
// asked for it now, whatever command the stored reply answered; the rest of
// it is kept as it was.
func TestReaddress(t *testing.T) {
	t.Parallel()
	stored, err := json.Marshal(wire.Reply{OK: true, Result: json.RawMessage(`{"charge_id":"ch_1"}`), InReplyTo: "first"})
	require.NoError(t, err)
	for _, tc := range []struct {
		commandID string
		want      wire.Reply
	}{
		{"second", wire.Reply{OK: true, Result: json.RawMessage(`{"charge_id":"ch_1"}`), InReplyTo: "second"}},
		{"", wire.Reply{OK: true, Result: json.RawMessage(`{"charge_id":"ch_1"}`)}},
		{"a\x00\xffb", wire.Reply{OK: true, Result: json.RawMessage(`{"charge_id":"ch_1"}`), InReplyTo: "a\x00\ufffdb"}},
	} {
		got, err := wire.DecodeReply(readdress(stored, tc.commandID))
		require.NoError(t, err)
		require.Equal(t, tc.want, got, "command id %q", tc.commandID)
	}
	// A payload this package did not write is sent as it is.
	for _, p := range []string{`[1]`, `null`, `not json`} {
		require.Equal(t, p, string(readdress([]byte(p), "x")))
	}
	// Fields a later version adds survive.
	require.JSONEq(t, `{"ok":false,"code":"c","later":{"a":1},"in_reply_to":"x"}`,
		string(readdress([]byte(`{"ok":false,"code":"c","later":{"a":1}}`), "x")))
}
