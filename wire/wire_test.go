package wire_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/wire"
)

func TestUUIDMatchesGoogleUUID(t *testing.T) {
	t.Parallel()
	id := uuid.New()
	require.Equal(t, id.String(), wire.UUID(id).String())
	for _, s := range []string{id.String(), strings.ToUpper(id.String()), "{" + id.String() + "}", "urn:uuid:" + id.String(),
		strings.ReplaceAll(id.String(), "-", "")} {
		got, err := wire.ParseUUID(s)
		require.NoError(t, err, s)
		require.Equal(t, wire.UUID(id), got, s)
	}
	for _, s := range []string{"", "nope", id.String()[:35] + "g", strings.ReplaceAll(id.String(), "-", "+"), strings.Repeat("a", 10000)} {
		_, err := wire.ParseUUID(s)
		require.Error(t, err, s)
		require.Less(t, len(err.Error()), 200, "the error does not quote a long input")
	}
}

func TestKeyRoundTrip(t *testing.T) {
	t.Parallel()
	k := wire.Key{SagaID: wire.UUID(uuid.New()), Step: "charge", Direction: wire.Compensate, Epoch: 3}
	got, err := wire.ParseKey(k.String())
	require.NoError(t, err)
	require.Equal(t, k, got)
	require.Equal(t, k.SagaID.String()+"/charge/compensate/3", k.String())
}

func TestParseKeyRejectsMalformedKeys(t *testing.T) {
	t.Parallel()
	id := uuid.NewString()
	for _, tc := range []struct{ in, want string }{
		{"", "want saga_id/step/direction/epoch"},
		{id + "/a/forward", "want saga_id/step/direction/epoch"},
		{"nope/a/forward/0", "saga id"},
		{id + "//forward/0", "empty step name"},
		{id + "/a/sideways/0", `direction "sideways"`},
		{id + "/a/forward/-1", `epoch "-1"`},
		{id + "/a/forward/x", `epoch "x"`},
		{id + "/ch\x00arge/forward/0", "is not 1 to 64 of letters"},
		{id + "/ch\xffarge/forward/0", "is not 1 to 64 of letters"},
		{id + "/a b/forward/0", "is not 1 to 64 of letters"},
		{id + "/" + strings.Repeat("s", 10_000) + "/forward/0", "is not 1 to 64 of letters"},
	} {
		_, err := wire.ParseKey(tc.in)
		require.ErrorContains(t, err, tc.want, "input %q", tc.in)
		require.Less(t, len(err.Error()), 600, "the error quotes a bounded part of the key")
	}
	require.True(t, wire.ValidName(strings.Repeat("a", wire.MaxNameBytes)))
	require.False(t, wire.ValidName(strings.Repeat("a", wire.MaxNameBytes+1)))
}

// TestMurmur2MatchesTheJavaClient checks the vectors of the Java client's
// own test (UtilsTest.testMurmur2 in apache/kafka) and of other ports of
// it, and the partitions the default partitioner gives them.
func TestMurmur2MatchesTheJavaClient(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		key  string
		hash int32
	}{
		{"21", -973932308},
		{"foobar", -790332482},
		{"a-little-bit-long-string", -985981536},
		{"a-little-bit-longer-string", -1486304829},
		{"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971},
		{"abc", 479470107},
		{"1", -1993445489},
		{"12", 126087238},
		{"123", -267702483},
		{"1234", -1614185708},
		{"12345", -1188365604},
	} {
		require.Equal(t, tc.hash, wire.Murmur2([]byte(tc.key)), "murmur2(%q)", tc.key)
	}
	// toPositive(murmur2(key)) % n: 1173551340, 1357151166, 479470107.
	for _, tc := range []struct {
		key     string
		n, want int
	}{
		{"21", 100, 40}, {"21", 12, 0}, {"foobar", 100, 66}, {"foobar", 10, 6}, {"abc", 12, 3}, {"abc", 1, 0},
	} {
		require.Equal(t, tc.want, wire.Partition([]byte(tc.key), tc.n), "partition of %q among %d", tc.key, tc.n)
	}
	require.Panics(t, func() { wire.Partition([]byte("x"), 0) })
}

func validCommand() map[string]any {
	return map[string]any{"saga_id": uuid.NewString(), "saga": "checkout", "step": "charge", "direction": "forward",
		"epoch": 2, "version": 7}
}

func encode(t *testing.T, fields map[string]any) []byte {
	b, err := json.Marshal(fields)
	require.NoError(t, err)
	return b
}

func TestCommandRoundTrip(t *testing.T) {
	t.Parallel()
	c := wire.Command{SagaID: wire.UUID(uuid.New()), Saga: "checkout", Step: "charge", Direction: wire.Compensate, Epoch: 1, Version: 9}
	for _, typ := range []string{wire.TypeStep, wire.TypeCancel} {
		got, err := wire.DecodeCommand(typ, wire.EncodeCommand(c))
		require.NoError(t, err)
		require.Equal(t, c, got)
	}
	require.Equal(t, wire.Key{SagaID: c.SagaID, Step: "charge", Direction: wire.Compensate, Epoch: 1}, c.Key())
	require.JSONEq(t, `{"saga_id":"`+c.SagaID.String()+`","saga":"checkout","step":"charge","direction":"compensate","epoch":1,"version":9}`,
		string(wire.EncodeCommand(c)))
}

// TestDecodeCommandToleratesUnknownFields: a newer engine that adds a
// field, during a rolling upgrade, is understood by an older one.
func TestDecodeCommandToleratesUnknownFields(t *testing.T) {
	t.Parallel()
	f := validCommand()
	f["added_later"] = map[string]any{"nested": []int{1, 2}}
	f["reason"] = "a step command may carry anything"
	c, err := wire.DecodeCommand(wire.TypeStep, encode(t, f))
	require.NoError(t, err)
	require.Equal(t, "charge", c.Step)
	require.Equal(t, int64(7), c.Version)

	// Only a cancel command's reason is refused: it was written by an
	// engine from before cancel requests became rows.
	_, err = wire.DecodeCommand(wire.TypeCancel, encode(t, f))
	require.ErrorContains(t, err, `field "reason"`)
	delete(f, "reason")
	_, err = wire.DecodeCommand(wire.TypeCancel, encode(t, f))
	require.NoError(t, err)
}

// TestDecodeCommandNamesTheBadField puts a NUL byte, invalid UTF-8, a 10 kB
// value and a value of the wrong type in every field in turn: each gives an
// error that names the field and stays short.
func TestDecodeCommandNamesTheBadField(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("x", 10<<10)
	values := map[string]string{
		"NUL":           `"a\u0000b"`,
		"invalid UTF-8": "\"a\xffb\"",
		"10 kB string":  `"` + long + `"`,
		"10 kB number":  strings.Repeat("9", 10<<10),
		"object":        `{"a":1}`,
		"wrong type":    `true`,
	}
	for _, field := range []string{"saga_id", "saga", "step", "direction", "epoch", "version"} {
		for name, value := range values {
			f := validCommand()
			delete(f, field)
			payload := encode(t, f)
			payload = append(payload[:len(payload)-1], []byte(`,"`+field+`":`+value+`}`)...)
			_, err := wire.DecodeCommand(wire.TypeStep, payload)
			require.Error(t, err, "%s in %s", name, field)
			require.Contains(t, err.Error(), `"`+field+`"`, "%s in %s: %v", name, field, err)
			require.Less(t, len(err.Error()), 300, "%s in %s: the error does not quote the value", name, field)
		}
	}
}

func TestDecodeCommandRefusesIncompleteCommands(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		typ     string
		payload string
		want    string
	}{
		{"orders.created", `{}`, `message type "orders.created" is not "sagaflow.step", "sagaflow.cancel", "sagaflow.wake" or "sagaflow.branch"`},
		{wire.TypeStep, `{not json`, "decode payload"},
		{wire.TypeStep, `[1,2]`, "decode payload: want a JSON object, got [1,2]"},
		{wire.TypeStep, ``, "decode payload"},
		{wire.TypeStep, `null`, "saga_id is missing"},
		{wire.TypeStep, `{"saga_id":"00000000-0000-0000-0000-000000000000"}`, "saga_id is missing"},
		{wire.TypeStep, `{"saga_id":"` + uuid.NewString() + `","step":"x"}`, "saga or step is missing"},
		{wire.TypeStep, `{"saga_id":"` + uuid.NewString() + `","saga":"s","step":"a/b","direction":"forward","version":1}`, "contains '/'"},
		{wire.TypeStep, `{"saga_id":"` + uuid.NewString() + `","saga":"s","step":"x","direction":"up","version":1}`, `direction "up"`},
		{wire.TypeStep, `{"saga_id":"` + uuid.NewString() + `","saga":"s","step":"x","direction":"forward","epoch":-1,"version":1}`, "epoch -1 is negative"},
		{wire.TypeStep, `{"saga_id":"` + uuid.NewString() + `","saga":"s","step":"x","direction":"forward"}`, "version 0 is not positive"},
	} {
		_, err := wire.DecodeCommand(tc.typ, []byte(tc.payload))
		require.ErrorContains(t, err, tc.want, "%s %s", tc.typ, tc.payload)
	}
}

func TestReplyRoundTrip(t *testing.T) {
	t.Parallel()
	for _, r := range []wire.Reply{
		{OK: true, Result: json.RawMessage(`{"id":"ch_1"}`)},
		{Error: "card declined", Code: "card_declined"},
		{Error: "card declined", Code: "card_declined", InReplyTo: "0193b0c4-7f2a-7c3e-9a41-5d2f8e6b1c0a"},
	} {
		payload, err := wire.EncodeReply(r)
		require.NoError(t, err)
		got, err := wire.DecodeReply(payload)
		require.NoError(t, err)
		require.Equal(t, r, got)
	}
	got, err := wire.DecodeReply([]byte(`{"ok":true,"result":[1],"retry_hint":"added later"}`))
	require.NoError(t, err, "unknown fields are ignored")
	require.Equal(t, wire.Reply{OK: true, Result: json.RawMessage(`[1]`)}, got)
}

func TestDecodeReplyNamesTheBadField(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ payload, want string }{
		{`{"ok":"yes"}`, `field "ok": want true or false, got "yes"`},
		{`{"ok":false,"error":42}`, `field "error": want a string, got 42`},
		{`{"ok":false,"code":{}}`, `field "code": want a string, got {}`},
		{`{"ok":false,"in_reply_to":7}`, `field "in_reply_to": want a string, got 7`},
		{`{"ok":false,"in_reply_to":"` + strings.Repeat("i", 10<<10) + `\u0000"}`, ""},
		{`{"ok":false,"code":"` + strings.Repeat("c", 10<<10) + `"}`, ""},
		{`{"ok":false,"error":"a\u0000b"}`, ""},
		{"{\"ok\":false,\"error\":\"a\xffb\"}", ""},
		{`"ok"`, "want a JSON object"},
		{`{"ok":tru`, "decode payload"},
	} {
		r, err := wire.DecodeReply([]byte(tc.payload))
		if tc.want == "" {
			// A refusal's text is taken whatever it holds: the engine makes
			// it storable rather than refuse a refusal.
			require.NoError(t, err, tc.payload)
			require.False(t, r.OK)
			continue
		}
		require.ErrorContains(t, err, tc.want, tc.payload)
	}
}

func FuzzParseKey(f *testing.F) {
	f.Add(uuid.NewString() + "/charge/forward/0")
	f.Add("a/b/c/d")
	f.Fuzz(func(t *testing.T, s string) {
		k, err := wire.ParseKey(s)
		if err != nil {
			return
		}
		again, err := wire.ParseKey(k.String())
		require.NoError(t, err)
		require.Equal(t, k, again)
	})
}

// FuzzDecodeCommand: any bytes under any type decode to a usable command
// or to an error, never a panic; a decoded command encodes to a payload
// that decodes to itself.
func FuzzDecodeCommand(f *testing.F) {
	id := uuid.NewString()
	f.Add(wire.TypeStep, []byte(`{"saga_id":"`+id+`","saga":"checkout","step":"charge","direction":"forward","epoch":0,"version":1}`))
	f.Add(wire.TypeCancel, []byte(`{"saga_id":"`+id+`","saga":"checkout","step":"charge","direction":"compensate","epoch":2,"version":9,"reason":"x"}`))
	f.Add(wire.TypeStep, []byte(`{"saga_id":"`+id+`","saga":"c","step":"s","direction":"forward","version":1,"new":{"a":[1]}}`))
	f.Add(wire.TypeStep, []byte(`{not json`))
	f.Add("orders.created", []byte(`{}`))
	f.Add(wire.TypeStep, []byte("{\"saga\":\"\xff\",\"step\":\"a\\u0000\"}"))
	f.Fuzz(func(t *testing.T, typ string, payload []byte) {
		c, err := wire.DecodeCommand(typ, payload)
		if err != nil {
			return
		}
		if c.SagaID.IsZero() || c.Saga == "" || c.Step == "" || !c.Direction.Valid() || c.Epoch < 0 || c.Version <= 0 {
			t.Fatalf("decoded an unusable command: %+v", c)
		}
		for _, s := range []string{c.Saga, c.Step} {
			require.NoError(t, wire.CheckText("name", s, wire.MaxNameBytes))
		}
		again, err := wire.DecodeCommand(typ, wire.EncodeCommand(c))
		require.NoError(t, err)
		require.Equal(t, c, again)
		k, err := wire.ParseKey(c.Key().String())
		require.NoError(t, err)
		require.Equal(t, c.Key(), k)
	})
}

// FuzzDecodeReply: any bytes decode to a reply or to an error, never a
// panic; a decoded reply encodes to a payload that decodes to itself.
func FuzzDecodeReply(f *testing.F) {
	f.Add([]byte(`{"ok":true,"result":{"id":"x"}}`))
	f.Add([]byte(`{"ok":false,"error":"declined","code":"card_declined","later":1}`))
	f.Add([]byte(`{"ok":"maybe"}`))
	f.Add([]byte("{\"error\":\"\xff\\u0000\"}"))
	f.Fuzz(func(t *testing.T, payload []byte) {
		r, err := wire.DecodeReply(payload)
		if err != nil {
			return
		}
		if len(r.Result) > 0 && !json.Valid(r.Result) {
			t.Fatalf("decoded a reply whose result is not JSON: %q", r.Result)
		}
		encoded, err := wire.EncodeReply(r)
		require.NoError(t, err)
		again, err := wire.DecodeReply(encoded)
		require.NoError(t, err)
		require.Equal(t, r.OK, again.OK)
		require.Equal(t, r.Error, again.Error)
		require.Equal(t, r.Code, again.Code)
	})
}
