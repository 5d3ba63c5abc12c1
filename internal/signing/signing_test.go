package signing

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
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

// The bytes docs/security.md says are signed are the bytes signed: a
// service in another language computes the HMAC over them by hand.
func TestTheDocumentedBytesAreSigned(t *testing.T) {
	t.Parallel()
	sagaID := "01a20942-939b-77f1-87d4-9bb925fd01e8"
	stepKey := sagaID + "/charge/forward/0"
	h := map[string]string{"sagaflow-type": "sagaflow.reply", "sagaflow-saga-id": sagaID, "sagaflow-step-key": stepKey,
		"sagaflow-message-id": "not signed"}
	value := []byte(`{"ok":true}`)
	key := []byte("k")
	by := hmac.New(sha256.New, key)
	by.Write([]byte("sagaflow-signature-v1" + "14:sagaflow.reply" + "36:" + sagaID + "53:" + stepKey + "0:" + "0:" + `11:{"ok":true}`))
	want := "v1=" + hex.EncodeToString(by.Sum(nil))
	require.Equal(t, want, Keys{Current: key}.Sign(func(n string) string { return h[n] }, value))
}
