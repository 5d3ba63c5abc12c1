// Package signing signs sagaflow's bus messages (commands, cancel requests,
// replies) with HMAC-SHA256 under a key the services share, and verifies
// them before any effect. Anyone who can write to a topic can forge an
// unsigned message; with a key set, a message without a valid signature is
// refused.
//
// # The signature
//
// The header [Header] carries "v1=" and the lowercase hex HMAC-SHA256 of the
// canonical bytes of the message under the key. The canonical bytes are the
// string "sagaflow-signature-v1", then, for each of the headers
// sagaflow-type, sagaflow-saga-id, sagaflow-step-key, sagaflow-direction and
// sagaflow-reply-to in that order, and then for the message's value: its
// length in bytes as a decimal number, a colon, and its bytes. An absent
// header counts as the empty string. Other headers (trace context, say) are
// not signed: relays and brokers may add them. The message id is not
// signed either: an engine that moves a command it cannot run yet back to
// its outbox publishes it again under a new id, and a signature cannot stop
// a replay of a whole message anyway (step keys and version fences do).
package signing

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strconv"
	"strings"

	"github.com/sagaflow/sagaflow/wire"
)

// Header is the header that carries the signature.
const Header = wire.HeaderSignature

// signed lists the headers the signature covers, in order.
var signed = [...]string{
	wire.HeaderType, wire.HeaderSagaID, wire.HeaderStepKey, wire.HeaderDirection, wire.HeaderReplyTo,
}

const version = "v1="

// Errors of [Keys.Verify].
var (
	ErrMissing = errors.New("signing: message has no " + Header + " header")
	ErrInvalid = errors.New("signing: signature does not match any accepted key")
)

// Keys signs with Current and accepts a signature under Current or any of
// Previous (for rotating the key without a stop). The zero Keys signs
// nothing and accepts everything.
type Keys struct {
	Current  []byte
	Previous [][]byte
}

// Enabled reports whether messages are signed and verified.
func (k Keys) Enabled() bool { return len(k.Current) > 0 }

// Sign returns the signature header's value for a message with these
// headers (looked up by get) and value; "" when signing is off.
func (k Keys) Sign(get func(string) string, value []byte) string {
	if !k.Enabled() {
		return ""
	}
	return version + hex.EncodeToString(mac(k.Current, get, value))
}

// SignMap sets the signature header in h for a message with value; it does
// nothing when signing is off.
func (k Keys) SignMap(h map[string]string, value []byte) {
	if !k.Enabled() {
		return
	}
	h[Header] = k.Sign(func(n string) string { return h[n] }, value)
}

// Verify checks the signature of a message whose headers get looks up
// (the signature header included). It returns nil when signing is off.
func (k Keys) Verify(get func(string) string, value []byte) error {
	if !k.Enabled() {
		return nil
	}
	sig := get(Header)
	if sig == "" {
		return ErrMissing
	}
	hexSig, ok := strings.CutPrefix(sig, version)
	if !ok {
		return ErrInvalid
	}
	got, err := hex.DecodeString(hexSig)
	if err != nil {
		return ErrInvalid
	}
	for _, key := range append([][]byte{k.Current}, k.Previous...) {
		if len(key) > 0 && hmac.Equal(got, mac(key, get, value)) {
			return nil
		}
	}
	return ErrInvalid
}

func mac(key []byte, get func(string) string, value []byte) []byte {
	h := hmac.New(sha256.New, key)
	h.Write([]byte("sagaflow-signature-v1"))
	field := func(b []byte) {
		h.Write([]byte(strconv.Itoa(len(b))))
		h.Write([]byte{':'})
		h.Write(b)
	}
	for _, name := range signed {
		field([]byte(get(name)))
	}
	field(value)
	return h.Sum(nil)
}
