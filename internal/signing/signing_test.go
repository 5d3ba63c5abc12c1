package signing

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestSignAndVerify(t *testing.T) {
	t.Parallel()
	k := Keys{Current: []byte("k1")}
	h := map[string]string{"sagaflow-message-id": "m1", "sagaflow-type": "t", "sagaflow-step-key": "s/x/forward/0"}
	k.SignMap(h, []byte(`{"a":1}`))
	get := func(n string) string { return h[n] }
	require.NoError(t, k.Verify(get, []byte(`{"a":1}`)))

	// Any change to a signed header or the value breaks it.
	require.ErrorIs(t, k.Verify(get, []byte(`{"a":2}`)), ErrInvalid)
	h["sagaflow-step-key"] = "s/y/forward/0"
	require.ErrorIs(t, k.Verify(get, []byte(`{"a":1}`)), ErrInvalid)
	h["sagaflow-step-key"] = "s/x/forward/0"
	// Moving bytes between fields does not keep a signature valid.
	h["sagaflow-type"], h["sagaflow-saga-id"] = "", "t"
	require.ErrorIs(t, k.Verify(get, []byte(`{"a":1}`)), ErrInvalid)
	h["sagaflow-type"], h["sagaflow-saga-id"] = "t", ""
	// Unsigned headers may be added or changed.
	h["sagaflow-message-id"] = "m2"
	h["traceparent"] = "00-abc"
	require.NoError(t, k.Verify(get, []byte(`{"a":1}`)))

	// Another key, a missing or garbled signature.
	require.ErrorIs(t, Keys{Current: []byte("k2")}.Verify(get, []byte(`{"a":1}`)), ErrInvalid)
	sig := h[Header]
	delete(h, Header)
	require.ErrorIs(t, k.Verify(get, []byte(`{"a":1}`)), ErrMissing)
	h[Header] = "v1=zz"
	require.ErrorIs(t, k.Verify(get, []byte(`{"a":1}`)), ErrInvalid)
	h[Header] = sig[3:]
	require.ErrorIs(t, k.Verify(get, []byte(`{"a":1}`)), ErrInvalid)

	// Rotation: a new key still accepts the old one's signatures.
	h[Header] = sig
	require.NoError(t, Keys{Current: []byte("k2"), Previous: [][]byte{[]byte("k1")}}.Verify(get, []byte(`{"a":1}`)))
	// Off: nothing signed, everything accepted.
	require.NoError(t, Keys{}.Verify(func(string) string { return "" }, nil))
	require.Empty(t, Keys{}.Sign(get, nil))
}
