package kafkaconfig

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/plain"
)

// SASL mechanisms a [SASLConfig] may name.
const (
	MechanismPlain       = "PLAIN"
	MechanismSCRAMSHA256 = "SCRAM-SHA-256"
	MechanismSCRAMSHA512 = "SCRAM-SHA-512"
)

// DialTimeoutDefault bounds establishing a connection to a broker, TLS
// handshake and SASL exchange included, in the dialers and transports a
// [Config] makes (kafka-go's own default for its DefaultDialer).
const DialTimeoutDefault = 10 * time.Second

// redacted stands for a password wherever a Config is shown.
const redacted = "[redacted]"

// Config says how to reach a Kafka cluster: its brokers, and how to
// authenticate and encrypt connections to them. Build one in code or with
// [FromEnv]; [Config.Dialer] and [Config.Transport] turn it into what
// kafka-go's readers and writers take.
//
// A Config never shows its password: String, GoString, LogValue and every
// error print "[redacted]" in its place.
type Config struct {
	// Brokers are the bootstrap brokers, each host:port. At least one is
	// required.
	Brokers []string
	// ClientID identifies this client to the brokers (in their logs and
	// quotas). Defaults to kafka-go's default, "program@host
	// (github.com/segmentio/kafka-go)".
	ClientID string
	// TLS, when set, encrypts connections and verifies the brokers'
	// certificates. Defaults to nil: no TLS.
	TLS *TLSConfig
	// SASL, when set, authenticates with a username and password. Defaults
	// to nil: no SASL.
	SASL *SASLConfig
	// AllowPlaintextCredentials permits SASL credentials over a connection
	// without TLS. Off by default: Validate refuses it, since PLAIN sends
	// the password as it is and SCRAM's exchange can be attacked offline.
	// Turn it on for a local cluster on a trusted network only.
	AllowPlaintextCredentials bool
}

// TLSConfig configures TLS. Its zero value is valid: TLS verified against
// the system's root certificates, without a client certificate.
type TLSConfig struct {
	// CAFile is a PEM file of the certificate authorities that signed the
	// brokers' certificates. Defaults to "": the system's roots.
	CAFile string
	// CertFile and KeyFile are PEM files of a client certificate and its
	// private key, for brokers that authenticate clients with mutual TLS
	// (ssl.client.auth=required). Set both or neither.
	CertFile, KeyFile string
	// ServerName is the name the brokers' certificates must be valid for.
	// Defaults to "": each broker's host name, as dialed.
	ServerName string
	// InsecureSkipVerify accepts any certificate the brokers present, so
	// anyone between this client and the brokers can read and change the
	// traffic, credentials included. For tests only.
	InsecureSkipVerify bool
}

// SASLConfig configures SASL authentication.
type SASLConfig struct {
	// Mechanism is MechanismPlain ("PLAIN"), MechanismSCRAMSHA256
	// ("SCRAM-SHA-256") or MechanismSCRAMSHA512 ("SCRAM-SHA-512"), in any
	// case. Required.
	Mechanism string
	// Username and Password are the credentials. Both are required.
	Username, Password string
}

// Validate reports whether c is usable, reading its TLS files as
// [Config.Dialer] would. Every problem found is reported, joined, each
// naming its field ("kafkaconfig: SASL.Mechanism: ..."); each matches
// [ErrInvalidConfig]. No error contains the password.
func (c *Config) Validate() error {
	_, _, err := c.build(fieldNames)
	return err
}

// Dialer returns a kafka-go dialer for c, for a kafka.Reader
// (kafka.ReaderConfig.Dialer), relay.WriterOpts.Dialer, kafka.WriterConfig or
// kafka.DialLeader. It validates c first, and reads the TLS files now: a
// certificate renewed on disk is picked up by the next call, not by this
// dialer.
func (c *Config) Dialer() (*kafka.Dialer, error) {
	tlsCfg, mech, err := c.build(fieldNames)
	if err != nil {
		return nil, err
	}
	return &kafka.Dialer{
		ClientID:      c.ClientID,
		Timeout:       DialTimeoutDefault,
		DualStack:     true,
		TLS:           tlsCfg,
		SASLMechanism: mech,
	}, nil
}

// Transport returns a kafka-go transport for c, for a kafka.Writer literal
// (kafka.Writer.Transport) or a kafka.Client. It validates c first, as
// [Config.Dialer] does.
//
// A transport keeps a pool of connections per broker, and goroutines that
// serve them, until its CloseIdleConnections is called; a writer's Close
// does not close a transport it was given. Call CloseIdleConnections once
// the writers and clients that use it are closed.
func (c *Config) Transport() (*kafka.Transport, error) {
	tlsCfg, mech, err := c.build(fieldNames)
	if err != nil {
		return nil, err
	}
	return &kafka.Transport{
		DialTimeout: DialTimeoutDefault,
		ClientID:    c.ClientID,
		TLS:         tlsCfg,
		SASL:        mech,
	}, nil
}

// namer says how an error names a setting: by its field in Config, or by
// its environment variable.
type namer interface {
	name(field string) string
	broker(i int) string
	// withSASL ends "SASL.Username: required ...".
	withSASL() string
	// noTLSHint ends "SASL: credentials would cross the network unencrypted: ...".
	noTLSHint() string
}

type fieldNamer struct{}

var fieldNames namer = fieldNamer{}

func (fieldNamer) name(field string) string { return field }
func (fieldNamer) broker(i int) string      { return "Brokers[" + strconv.Itoa(i) + "]" }
func (fieldNamer) withSASL() string         { return "required with SASL" }
func (fieldNamer) noTLSHint() string        { return "set TLS, or AllowPlaintextCredentials to permit it" }

// build validates c and makes its TLS configuration and SASL mechanism
// (each nil when c has none).
func (c *Config) build(n namer) (*tls.Config, sasl.Mechanism, error) {
	if c == nil {
		return nil, nil, &configError{msg: "kafkaconfig: config is nil"}
	}
	var password string
	if c.SASL != nil {
		password = c.SASL.Password
	}
	var errs []error
	fail := func(field string, cause error, format string, args ...any) {
		msg := "kafkaconfig: " + field + ": " + fmt.Sprintf(format, args...)
		if password != "" && strings.Contains(msg, password) {
			// A password pasted into the wrong field, or into a broker URL.
			msg = redact(msg, password)
			cause = nil
		}
		if cause != nil && password != "" && strings.Contains(cause.Error(), password) {
			cause = nil
		}
		errs = append(errs, &configError{msg: msg, cause: cause})
	}

	if len(c.Brokers) == 0 {
		fail(n.name("Brokers"), nil, "no brokers (want at least one host:port)")
	}
	for i, b := range c.Brokers {
		if problem := checkBroker(b); problem != "" {
			fail(n.broker(i), nil, "%q is not host:port: %s", b, problem)
		}
	}

	var tlsCfg *tls.Config
	if t := c.TLS; t != nil {
		tlsCfg = &tls.Config{
			MinVersion:         tls.VersionTLS12,
			ServerName:         t.ServerName,
			InsecureSkipVerify: t.InsecureSkipVerify, //nolint:gosec // the user's explicit choice, documented as for tests only
		}
		if t.CAFile != "" {
			roots, err := loadCA(t.CAFile)
			if err != nil {
				fail(n.name("TLS.CAFile"), err, "%v", err)
			}
			tlsCfg.RootCAs = roots
		}
		switch {
		case t.CertFile != "" && t.KeyFile == "":
			fail(n.name("TLS.KeyFile"), nil, "required with %s (the client certificate's private key)", n.name("TLS.CertFile"))
		case t.CertFile == "" && t.KeyFile != "":
			fail(n.name("TLS.CertFile"), nil, "required with %s (the client certificate)", n.name("TLS.KeyFile"))
		case t.CertFile != "":
			cert, field, err := loadKeyPair(t.CertFile, t.KeyFile, n)
			if err != nil {
				fail(field, err, "%v", err)
			} else {
				tlsCfg.Certificates = []tls.Certificate{cert}
			}
		}
	}

	var mech sasl.Mechanism
	if s := c.SASL; s != nil {
		if s.Username == "" {
			fail(n.name("SASL.Username"), nil, "%s", n.withSASL())
		}
		if s.Password == "" {
			fail(n.name("SASL.Password"), nil, "%s", n.withSASL())
		}
		if strings.ContainsRune(s.Username, 0) {
			fail(n.name("SASL.Username"), nil, "contains a NUL character, which SASL cannot carry")
		}
		if strings.ContainsRune(s.Password, 0) {
			fail(n.name("SASL.Password"), nil, "contains a NUL character, which SASL cannot carry")
		}
		switch m := strings.ToUpper(strings.TrimSpace(s.Mechanism)); m {
		case MechanismPlain:
			mech = plain.Mechanism{Username: s.Username, Password: s.Password}
		case MechanismSCRAMSHA256, MechanismSCRAMSHA512:
			mech = newSCRAM(m, s.Username, s.Password)
		case "":
			fail(n.name("SASL.Mechanism"), nil, "%s (want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)", n.withSASL())
		default:
			fail(n.name("SASL.Mechanism"), nil, "unknown mechanism %q (want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)", s.Mechanism)
		}
		if c.TLS == nil && !c.AllowPlaintextCredentials {
			fail(n.name("SASL"), nil, "credentials would cross the network unencrypted: %s", n.noTLSHint())
		}
	}

	switch len(errs) {
	case 0:
		return tlsCfg, mech, nil
	case 1:
		return nil, nil, errs[0] // unwraps to its cause
	default:
		return nil, nil, errors.Join(errs...)
	}
}

// checkBroker returns what is wrong with a broker address, or "".
func checkBroker(b string) string {
	if strings.ContainsAny(b, " \t\r\n") {
		return "it contains white space"
	}
	host, port, err := net.SplitHostPort(b)
	if err != nil {
		var ae *net.AddrError
		if errors.As(err, &ae) {
			return ae.Err
		}
		return err.Error()
	}
	if host == "" {
		return "no host"
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
		return fmt.Sprintf("port %q is not a number from 1 to 65535", port)
	}
	return ""
}

func loadCA(file string) (*x509.CertPool, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("read CA certificates: %w", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(data) {
		return nil, fmt.Errorf("%s holds no PEM certificate", file)
	}
	return roots, nil
}

// loadKeyPair loads a client certificate, and names the field at fault
// when it cannot.
func loadKeyPair(certFile, keyFile string, n namer) (tls.Certificate, string, error) {
	certPEM, err := os.ReadFile(certFile)
	if err != nil {
		return tls.Certificate{}, n.name("TLS.CertFile"), fmt.Errorf("read client certificate: %w", err)
	}
	if !hasPEMBlock(certPEM, "CERTIFICATE") {
		return tls.Certificate{}, n.name("TLS.CertFile"), fmt.Errorf("%s holds no PEM certificate", certFile)
	}
	keyPEM, err := os.ReadFile(keyFile)
	if err != nil {
		return tls.Certificate{}, n.name("TLS.KeyFile"), fmt.Errorf("read client key: %w", err)
	}
	// crypto/tls's errors describe the problem, never the key's bytes.
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return tls.Certificate{}, n.name("TLS.KeyFile"), fmt.Errorf("%s with the certificate in %s: %w", keyFile, certFile, err)
	}
	return cert, "", nil
}

func hasPEMBlock(data []byte, typ string) bool {
	for {
		var b *pem.Block
		b, data = pem.Decode(data)
		if b == nil {
			return false
		}
		if b.Type == typ {
			return true
		}
	}
}

// String describes c without its password.
func (c Config) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "kafkaconfig.Config{Brokers: %q", c.Brokers)
	if c.ClientID != "" {
		fmt.Fprintf(&b, ", ClientID: %q", c.ClientID)
	}
	if c.TLS != nil {
		fmt.Fprintf(&b, ", TLS: %s", c.TLS.String())
	}
	if c.SASL != nil {
		fmt.Fprintf(&b, ", SASL: %s", c.SASL.String())
	}
	if c.AllowPlaintextCredentials {
		b.WriteString(", AllowPlaintextCredentials: true")
	}
	b.WriteString("}")
	if c.SASL != nil {
		// A password pasted into the wrong field, or into a broker URL.
		return redact(b.String(), c.SASL.Password)
	}
	return b.String()
}

// GoString is String, so that %#v does not show the password either.
func (c Config) GoString() string { return c.String() }

// LogValue describes c to log/slog without its password.
func (c Config) LogValue() slog.Value { return slog.StringValue(c.String()) }

// String describes t.
func (t TLSConfig) String() string {
	return fmt.Sprintf("{CAFile: %q, CertFile: %q, KeyFile: %q, ServerName: %q, InsecureSkipVerify: %t}",
		t.CAFile, t.CertFile, t.KeyFile, t.ServerName, t.InsecureSkipVerify)
}

// String describes s without its password.
func (s SASLConfig) String() string {
	pw := ""
	if s.Password != "" {
		pw = redacted
	}
	return redact(fmt.Sprintf("{Mechanism: %q, Username: %q, Password: %s}", s.Mechanism, s.Username, pw), s.Password)
}

// redact replaces password in s.
func redact(s, password string) string {
	if password == "" {
		return s
	}
	return strings.ReplaceAll(s, password, redacted)
}

// GoString is String, so that %#v does not show the password either.
func (s SASLConfig) GoString() string { return s.String() }

// LogValue describes s to log/slog without its password.
func (s SASLConfig) LogValue() slog.Value { return slog.StringValue(s.String()) }
