package kafkaconfig

import (
	"context"
	"crypto/hmac"
	"crypto/pbkdf2"
	"crypto/rand"
	"crypto/sha256"
	"crypto/sha512"
	"encoding/base64"
	"errors"
	"fmt"
	"hash"
	"strconv"
	"strings"

	"github.com/segmentio/kafka-go/sasl"
)

// This file is a SCRAM client (RFC 5802, with SHA-256 and SHA-512 as in
// RFC 7677 and Kafka's KIP-84) on the standard library.
//
// kafka-go's own, github.com/segmentio/kafka-go/sasl/scram, imports
// github.com/xdg-go/scram and with it two more modules that sagaflow's
// go.mod does not list. This client does what Kafka's Java client does:
// no channel binding, no extensions, the username escaped (',' as "=2C",
// '=' as "=3D") and both credentials sent as UTF-8 without SASLprep.

// scramMinIterations is the fewest PBKDF2 iterations accepted from a
// server: Kafka's own minimum. A server asking for fewer could be an
// attacker making the password cheap to guess from the exchange.
const scramMinIterations = 4096

type scramMechanism struct {
	name     string
	hash     func() hash.Hash
	username string
	password string
}

var _ sasl.Mechanism = (*scramMechanism)(nil)

func newSCRAM(name string, username, password string) *scramMechanism {
	h := sha256.New
	if name == MechanismSCRAMSHA512 {
		h = sha512.New
	}
	return &scramMechanism{name: name, hash: h, username: username, password: password}
}

func (m *scramMechanism) Name() string { return m.name }

// String does not show the password.
func (m *scramMechanism) String() string {
	return fmt.Sprintf("%s{Username: %q, Password: %s}", m.name, m.username, redacted)
}

// GoString is String, so that %#v does not show the password either.
func (m *scramMechanism) GoString() string { return m.String() }

var scramEscaper = strings.NewReplacer("=", "=3D", ",", "=2C")

func (m *scramMechanism) Start(context.Context) (sasl.StateMachine, []byte, error) {
	nonce := make([]byte, 24)
	if _, err := rand.Read(nonce); err != nil {
		return nil, nil, fmt.Errorf("kafkaconfig: %s: nonce: %w", m.name, err)
	}
	s := &scramSession{m: m, nonce: base64.RawStdEncoding.EncodeToString(nonce)}
	s.clientFirstBare = "n=" + scramEscaper.Replace(m.username) + ",r=" + s.nonce
	return s, []byte("n,," + s.clientFirstBare), nil
}

// scramSession is one exchange, on one connection.
type scramSession struct {
	m               *scramMechanism
	nonce           string
	clientFirstBare string
	step            int
	serverSignature []byte
}

func (s *scramSession) Next(_ context.Context, challenge []byte) (bool, []byte, error) {
	s.step++
	switch s.step {
	case 1:
		final, err := s.clientFinal(string(challenge))
		if err != nil {
			return false, nil, fmt.Errorf("kafkaconfig: %s: %w", s.m.name, err)
		}
		return false, []byte(final), nil
	case 2:
		if err := s.verifyServerFinal(string(challenge)); err != nil {
			return false, nil, fmt.Errorf("kafkaconfig: %s: %w", s.m.name, err)
		}
		return true, nil, nil
	default:
		return false, nil, fmt.Errorf("kafkaconfig: %s: unexpected challenge after the exchange ended", s.m.name)
	}
}

// clientFinal answers the server-first-message "r=NONCE,s=SALT,i=ITERATIONS".
func (s *scramSession) clientFinal(serverFirst string) (string, error) {
	attrs, err := scramAttrs(serverFirst)
	if err != nil {
		return "", fmt.Errorf("server-first-message: %w", err)
	}
	nonce, salt64, iters := attrs["r"], attrs["s"], attrs["i"]
	if !strings.HasPrefix(nonce, s.nonce) || len(nonce) == len(s.nonce) {
		return "", errors.New("server-first-message: the server's nonce does not extend the client's")
	}
	salt, err := base64.StdEncoding.DecodeString(salt64)
	if err != nil || len(salt) == 0 {
		return "", errors.New("server-first-message: the salt is not base64")
	}
	n, err := strconv.Atoi(iters)
	if err != nil || n < scramMinIterations {
		return "", fmt.Errorf("server-first-message: %q iterations, fewer than %d or not a number", iters, scramMinIterations)
	}
	salted, err := pbkdf2.Key(s.m.hash, s.m.password, salt, n, s.m.hash().Size())
	if err != nil {
		// crypto/pbkdf2's errors describe the parameters, never the password.
		return "", fmt.Errorf("derive the salted password: %w", err)
	}
	withoutProof := "c=biws,r=" + nonce // biws: base64 of the GS2 header "n,,"
	authMessage := []byte(s.clientFirstBare + "," + serverFirst + "," + withoutProof)

	clientKey := s.hmac(salted, []byte("Client Key"))
	h := s.m.hash()
	h.Write(clientKey)
	storedKey := h.Sum(nil)
	proof := s.hmac(storedKey, authMessage)
	for i := range proof {
		proof[i] ^= clientKey[i]
	}
	s.serverSignature = s.hmac(s.hmac(salted, []byte("Server Key")), authMessage)
	return withoutProof + ",p=" + base64.StdEncoding.EncodeToString(proof), nil
}

// verifyServerFinal checks the server-final-message "v=SIGNATURE": the
// server proves that it knows the credentials too.
func (s *scramSession) verifyServerFinal(serverFinal string) error {
	attrs, err := scramAttrs(serverFinal)
	if err != nil {
		return fmt.Errorf("server-final-message: %w", err)
	}
	if e, ok := attrs["e"]; ok {
		return fmt.Errorf("the server refused: %s", e)
	}
	sig, err := base64.StdEncoding.DecodeString(attrs["v"])
	if err != nil || !hmac.Equal(sig, s.serverSignature) {
		return errors.New("the server's signature does not verify: it does not know these credentials")
	}
	return nil
}

func (s *scramSession) hmac(key, msg []byte) []byte {
	mac := hmac.New(s.m.hash, key)
	mac.Write(msg)
	return mac.Sum(nil)
}

// scramAttrs splits "a=x,b=y" into its attributes. A mandatory extension
// ("m=") is refused, as RFC 5802 requires.
func scramAttrs(msg string) (map[string]string, error) {
	attrs := map[string]string{}
	for part := range strings.SplitSeq(msg, ",") {
		k, v, ok := strings.Cut(part, "=")
		if !ok || len(k) != 1 {
			return nil, fmt.Errorf("malformed attribute %q", part)
		}
		if k == "m" {
			return nil, errors.New("mandatory extension not supported")
		}
		attrs[k] = v
	}
	return attrs, nil
}
