package kafkaconfig_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// pki is a throwaway certificate authority with a server certificate for
// 127.0.0.1 and a client certificate, all signed by it, written as PEM files
// to a test's temporary directory.
type pki struct {
	caCert     *x509.Certificate
	clientCert *x509.Certificate
	server     tls.Certificate // for a listener

	caFile, clientCertFile, clientKeyFile string
	otherKeyFile                          string // a key that belongs to no certificate here
	garbageFile                           string // not PEM
}

func newPKI(t *testing.T) *pki {
	t.Helper()
	dir := t.TempDir()
	p := &pki{}

	caKey := newKey(t)
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "sagaflow test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	p.caCert = sign(t, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	p.caFile = writePEM(t, dir, "ca.pem", "CERTIFICATE", p.caCert.Raw)

	serverKey := newKey(t)
	serverCert := sign(t, &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "broker"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:     []string{"localhost"},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, p.caCert, &serverKey.PublicKey, caKey)
	p.server = tls.Certificate{Certificate: [][]byte{serverCert.Raw}, PrivateKey: serverKey, Leaf: serverCert}

	clientKey := newKey(t)
	p.clientCert = sign(t, &x509.Certificate{
		SerialNumber: big.NewInt(3),
		Subject:      pkix.Name{CommonName: "sagaflow"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, p.caCert, &clientKey.PublicKey, caKey)
	p.clientCertFile = writePEM(t, dir, "client.pem", "CERTIFICATE", p.clientCert.Raw)
	p.clientKeyFile = writePEM(t, dir, "client-key.pem", "PRIVATE KEY", marshalKey(t, clientKey))
	p.otherKeyFile = writePEM(t, dir, "other-key.pem", "PRIVATE KEY", marshalKey(t, newKey(t)))

	p.garbageFile = filepath.Join(dir, "garbage.txt")
	require.NoError(t, os.WriteFile(p.garbageFile, []byte("not a certificate\n"), 0o600))
	return p
}

// serverTLS is the brokers' side: their certificate, and client
// certificates required and checked against the CA (mutual TLS).
func (p *pki) serverTLS() *tls.Config {
	clients := x509.NewCertPool()
	clients.AddCert(p.caCert)
	return &tls.Config{
		Certificates: []tls.Certificate{p.server},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    clients,
		MinVersion:   tls.VersionTLS12,
	}
}

func newKey(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	return k
}

func sign(t *testing.T, tmpl, parent *x509.Certificate, pub *ecdsa.PublicKey, signer *ecdsa.PrivateKey) *x509.Certificate {
	t.Helper()
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, pub, signer)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	return cert
}

func marshalKey(t *testing.T, k *ecdsa.PrivateKey) []byte {
	t.Helper()
	der, err := x509.MarshalPKCS8PrivateKey(k)
	require.NoError(t, err)
	return der
}

func writePEM(t *testing.T, dir, name, typ string, der []byte) string {
	t.Helper()
	file := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(file, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600))
	return file
}
