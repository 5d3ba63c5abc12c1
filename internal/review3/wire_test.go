// Package review3_test is an outside review of sagaflow's wire protocol as
// docs/protocol.md states it for services in other languages: commands and
// replies built by hand, as raw bytes over Kafka, against the real engine and
// participant, on a real PostgreSQL and an in-process Kafka (kfake). A test
// that passes documents a promise kept; a finding is a test skipped with
// "FINDING:" and the sentence of the docs it contradicts.
package review3_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/wire"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The Java client's own vectors (org.apache.kafka.common.utils.UtilsTest,
// testMurmur2), which docs/protocol.md says Murmur2 is tested against.
func TestMurmur2JavaVectors(t *testing.T) {
	cases := map[string]int32{
		"21":                         -973932308,
		"foobar":                     -790332482,
		"a-little-bit-long-string":   -985981536,
		"a-little-bit-longer-string": -1486304829,
		"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
		"abc": 479470107,
	}
	for in, want := range cases {
		require.Equal(t, want, wire.Murmur2([]byte(in)), "murmur2(%q)", in)
		// partition = toPositive(murmur2(key)) % n, toPositive(x) = x & 0x7fffffff
		for _, n := range []int{1, 3, 7, 12, 100} {
			require.Equal(t, int(uint32(want)&0x7fffffff)%n, wire.Partition([]byte(in), n), "partition(%q, %d)", in, n)
		}
	}
	require.Panics(t, func() { wire.Partition([]byte("x"), 0) }, "Partition with 0 partitions must panic, as its doc says")
}

func TestStepKeyCanonicalFormRoundTrip(t *testing.T) {
	const s = "0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e/charge/forward/0"
	k, err := wire.ParseKey(s)
	require.NoError(t, err)
	require.Equal(t, "charge", k.Step)
	require.Equal(t, wire.Forward, k.Direction)
	require.Equal(t, 0, k.Epoch)
	require.Equal(t, s, k.String())

	// Other UUID forms are accepted and written back canonical.
	for _, id := range []string{
		"0193A0F4-6A8E-7C4B-9D6E-2F1A3B4C5D6E",
		"{0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e}",
		"urn:uuid:0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e",
		"0193a0f46a8e7c4b9d6e2f1a3b4c5d6e",
	} {
		k, err := wire.ParseKey(id + "/charge/compensate/12")
		require.NoError(t, err, id)
		require.Equal(t, "0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e/charge/compensate/12", k.String(), id)
	}

	// Shapes the doc rules out.
	for _, bad := range []string{
		"",
		"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e/charge/forward",
		"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e/charge/forward/0/x",
		"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e//forward/0",
		"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e/charge/sideways/0",
		"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e/charge/forward/-1",
		"not-a-uuid/charge/forward/0",
	} {
		_, err := wire.ParseKey(bad)
		require.Error(t, err, "ParseKey(%q)", bad)
	}
}

// "epoch: a non-negative decimal integer without leading zeros" and
// "Key.String ... is the only encoder": a key with a leading zero or a plus
// sign is not in canonical form, so a parse that accepts it must at least not
// round-trip to a different string silently.
func TestStepKeyEpochLeadingZero(t *testing.T) {
	for _, s := range []string{
		"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e/charge/forward/01",
		"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e/charge/forward/+1",
	} {
		// Was a finding: both parsed, as the key .../1.
		_, err := wire.ParseKey(s)
		require.ErrorContains(t, err, "without sign or leading zeros", s)
	}
}

func TestDecodeReplyPerDoc(t *testing.T) {
	r, err := wire.DecodeReply([]byte(`{"ok":true,"result":{"charge_id":"ch_3Pq"}}`))
	require.NoError(t, err)
	require.True(t, r.OK)
	require.JSONEq(t, `{"charge_id":"ch_3Pq"}`, string(r.Result))

	r, err = wire.DecodeReply([]byte(`{"ok":false,"error":"card declined by the issuer","code":"card_declined"}`))
	require.NoError(t, err)
	require.False(t, r.OK)
	require.Equal(t, "card_declined", r.Code)

	// Unknown fields are ignored (rolling upgrades).
	r, err = wire.DecodeReply([]byte(`{"ok":true,"result":1,"v2_field":{"x":[1,2]},"trace":"abc"}`))
	require.NoError(t, err)
	require.True(t, r.OK)

	// ok absent: refused.
	r, err = wire.DecodeReply([]byte(`{"error":"x"}`))
	require.NoError(t, err)
	require.False(t, r.OK)

	for _, bad := range []string{`{"ok":"yes"}`, `{"ok":true,"error":1}`, `{"code":false}`, `not json`, ``} {
		_, err := wire.DecodeReply([]byte(bad))
		require.Error(t, err, bad)
	}
	// A 10 kB error is not refused for its text.
	_, err = wire.DecodeReply([]byte(`{"ok":false,"error":"` + strings.Repeat("e", 10240) + `","code":"` + strings.Repeat("c", 10240) + `"}`))
	require.NoError(t, err)
}

func TestDecodeCommandPerDoc(t *testing.T) {
	const ok = `{"saga_id":"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e","saga":"checkout","step":"charge","direction":"forward","epoch":0,"version":3}`
	c, err := wire.DecodeCommand(wire.TypeStep, []byte(ok))
	require.NoError(t, err)
	require.Equal(t, "0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e/charge/forward/0", c.Key().String())

	c, err = wire.DecodeCommand(wire.TypeStep, []byte(`{"saga_id":"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e","saga":"checkout","step":"charge","direction":"forward","version":3,"new":1}`))
	require.NoError(t, err, "epoch absent is 0 and unknown fields are ignored")
	require.Equal(t, 0, c.Epoch)

	long := strings.Repeat("s", 10240)
	bad := map[string]string{
		"step":      `{"saga_id":"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e","saga":"checkout","step":"` + long + `","direction":"forward","version":3}`,
		"saga":      `{"saga_id":"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e","saga":"a\u0000b","step":"charge","direction":"forward","version":3}`,
		"saga_id":   `{"saga_id":"00000000-0000-0000-0000-000000000000","saga":"checkout","step":"charge","direction":"forward","version":3}`,
		"direction": `{"saga_id":"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e","saga":"checkout","step":"charge","direction":"up","version":3}`,
		"version":   `{"saga_id":"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e","saga":"checkout","step":"charge","direction":"forward","version":0}`,
		"epoch":     `{"saga_id":"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e","saga":"checkout","step":"charge","direction":"forward","version":3,"epoch":` + strings.Repeat("9", 10240) + `}`,
	}
	for field, p := range bad {
		_, err := wire.DecodeCommand(wire.TypeStep, []byte(p))
		require.Error(t, err, field)
		require.Contains(t, err.Error(), field, "the error names the field")
		require.Less(t, len(err.Error()), 400, "the error never quotes more than a few bytes of the value: %q", err.Error()[:min(len(err.Error()), 200)])
	}
	// A step name with "/" is refused ("the same, and no /").
	_, err = wire.DecodeCommand(wire.TypeStep, []byte(`{"saga_id":"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e","saga":"checkout","step":"a/b","direction":"forward","version":3}`))
	require.Error(t, err)
	// A cancel with a reason is refused.
	_, err = wire.DecodeCommand(wire.TypeCancel, []byte(`{"saga_id":"0193a0f4-6a8e-7c4b-9d6e-2f1a3b4c5d6e","saga":"checkout","step":"charge","direction":"forward","version":3,"reason":"x"}`))
	require.Error(t, err)
}
