package kafkaconfig_test

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"strings"
	"testing"

	"github.com/segmentio/kafka-go/sasl/plain"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/kafkaconfig"
)

// TestMain checks for leaked goroutines after the tests (kafka-go
// transports and readers start some).
func TestMain(m *testing.M) { pgtest.Main(m) }

// secret is the password of every test config: no error and no String may
// contain it.
const secret = "s3cret-Pa55w0rd!"

func requireNoSecret(t *testing.T, text string) {
	t.Helper()
	require.NotContains(t, text, secret, "the password leaked")
}

// env is a getenv over a map.
func env(vars map[string]string) func(string) string {
	return func(key string) string { return vars[key] }
}

// with returns base with vars added (an empty value deletes).
func with(base map[string]string, vars map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range base {
		out[k] = v
	}
	for k, v := range vars {
		if v == "" {
			delete(out, k)
			continue
		}
		out[k] = v
	}
	return out
}

func TestValidateErrorsNameTheField(t *testing.T) {
	t.Parallel()
	p := newPKI(t)
	tlsOK := &kafkaconfig.TLSConfig{CAFile: p.caFile}
	sasl := func(mech, user, pass string) *kafkaconfig.SASLConfig {
		return &kafkaconfig.SASLConfig{Mechanism: mech, Username: user, Password: pass}
	}
	ok := func() kafkaconfig.Config {
		return kafkaconfig.Config{Brokers: []string{"k1:9092", "k2:9092"}, TLS: tlsOK, SASL: sasl("PLAIN", "app", secret)}
	}
	tests := []struct {
		name   string
		modify func(c *kafkaconfig.Config)
		want   string // the whole error, or a part of it
		is     error  // matched with errors.Is, besides ErrInvalidConfig
	}{
		{"no brokers", func(c *kafkaconfig.Config) { c.Brokers = nil }, "kafkaconfig: Brokers: no brokers (want at least one host:port)", nil},
		{"broker without port", func(c *kafkaconfig.Config) { c.Brokers = []string{"k1:9092", "k2"} },
			`kafkaconfig: Brokers[1]: "k2" is not host:port: missing port in address`, nil},
		{"broker without host", func(c *kafkaconfig.Config) { c.Brokers = []string{":9092"} }, `kafkaconfig: Brokers[0]: ":9092" is not host:port: no host`, nil},
		{"broker port out of range", func(c *kafkaconfig.Config) { c.Brokers = []string{"k1:70000"} },
			`kafkaconfig: Brokers[0]: "k1:70000" is not host:port: port "70000" is not a number from 1 to 65535`, nil},
		{"broker URL", func(c *kafkaconfig.Config) { c.Brokers = []string{"kafka://k1:9092"} }, `kafkaconfig: Brokers[0]: "kafka://k1:9092" is not host:port`, nil},
		{"broker with spaces", func(c *kafkaconfig.Config) { c.Brokers = []string{" k1:9092"} }, "it contains white space", nil},
		{"password in a broker URL", func(c *kafkaconfig.Config) { c.Brokers = []string{"app:" + secret + "@k1:9092"} },
			`kafkaconfig: Brokers[0]: "app:[redacted]@k1:9092" is not host:port`, nil},
		{"missing CA file", func(c *kafkaconfig.Config) { c.TLS = &kafkaconfig.TLSConfig{CAFile: p.caFile + ".missing"} },
			"kafkaconfig: TLS.CAFile: read CA certificates: open " + p.caFile + ".missing: no such file or directory", fs.ErrNotExist},
		{"CA file not PEM", func(c *kafkaconfig.Config) { c.TLS = &kafkaconfig.TLSConfig{CAFile: p.garbageFile} },
			"kafkaconfig: TLS.CAFile: " + p.garbageFile + " holds no PEM certificate", nil},
		{"certificate without key", func(c *kafkaconfig.Config) { c.TLS = &kafkaconfig.TLSConfig{CertFile: p.clientCertFile} },
			"kafkaconfig: TLS.KeyFile: required with TLS.CertFile (the client certificate's private key)", nil},
		{"key without certificate", func(c *kafkaconfig.Config) { c.TLS = &kafkaconfig.TLSConfig{KeyFile: p.clientKeyFile} },
			"kafkaconfig: TLS.CertFile: required with TLS.KeyFile (the client certificate)", nil},
		{"missing certificate file", func(c *kafkaconfig.Config) {
			c.TLS = &kafkaconfig.TLSConfig{CertFile: p.clientCertFile + ".missing", KeyFile: p.clientKeyFile}
		}, "kafkaconfig: TLS.CertFile: read client certificate: open", fs.ErrNotExist},
		{"certificate file not PEM", func(c *kafkaconfig.Config) {
			c.TLS = &kafkaconfig.TLSConfig{CertFile: p.garbageFile, KeyFile: p.clientKeyFile}
		}, "kafkaconfig: TLS.CertFile: " + p.garbageFile + " holds no PEM certificate", nil},
		{"missing key file", func(c *kafkaconfig.Config) {
			c.TLS = &kafkaconfig.TLSConfig{CertFile: p.clientCertFile, KeyFile: p.clientKeyFile + ".missing"}
		}, "kafkaconfig: TLS.KeyFile: read client key: open", fs.ErrNotExist},
		{"key of another certificate", func(c *kafkaconfig.Config) {
			c.TLS = &kafkaconfig.TLSConfig{CertFile: p.clientCertFile, KeyFile: p.otherKeyFile}
		}, "kafkaconfig: TLS.KeyFile: " + p.otherKeyFile + " with the certificate in " + p.clientCertFile + ": tls: private key does not match public key", nil},
		{"key file not PEM", func(c *kafkaconfig.Config) {
			c.TLS = &kafkaconfig.TLSConfig{CertFile: p.clientCertFile, KeyFile: p.garbageFile}
		}, "kafkaconfig: TLS.KeyFile: " + p.garbageFile + " with the certificate in", nil},
		{"unknown mechanism", func(c *kafkaconfig.Config) { c.SASL.Mechanism = "GSSAPI" },
			`kafkaconfig: SASL.Mechanism: unknown mechanism "GSSAPI" (want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)`, nil},
		{"password as the mechanism", func(c *kafkaconfig.Config) { c.SASL.Mechanism = secret },
			`kafkaconfig: SASL.Mechanism: unknown mechanism "[redacted]"`, nil},
		{"no mechanism", func(c *kafkaconfig.Config) { c.SASL.Mechanism = "" },
			"kafkaconfig: SASL.Mechanism: required with SASL (want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)", nil},
		{"no username", func(c *kafkaconfig.Config) { c.SASL.Username = "" }, "kafkaconfig: SASL.Username: required with SASL", nil},
		{"no password", func(c *kafkaconfig.Config) { c.SASL.Password = "" }, "kafkaconfig: SASL.Password: required with SASL", nil},
		{"NUL in the password", func(c *kafkaconfig.Config) { c.SASL.Password = secret + "\x00" },
			"kafkaconfig: SASL.Password: contains a NUL character, which SASL cannot carry", nil},
		{"credentials without TLS", func(c *kafkaconfig.Config) { c.TLS = nil },
			"kafkaconfig: SASL: credentials would cross the network unencrypted: set TLS, or AllowPlaintextCredentials to permit it", nil},
		{"SCRAM without TLS", func(c *kafkaconfig.Config) { c.TLS, c.SASL.Mechanism = nil, "SCRAM-SHA-512" },
			"kafkaconfig: SASL: credentials would cross the network unencrypted", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c := ok()
			tt.modify(&c)
			err := c.Validate()
			require.Error(t, err)
			require.ErrorIs(t, err, kafkaconfig.ErrInvalidConfig)
			require.Contains(t, err.Error(), tt.want)
			require.NotContains(t, err.Error(), "\n", "one problem, one line")
			if tt.is != nil {
				require.ErrorIs(t, err, tt.is)
			}
			requireNoSecret(t, err.Error())
			for e := errors.Unwrap(err); e != nil; e = errors.Unwrap(e) {
				requireNoSecret(t, e.Error()) // the cause, for the file errors
			}
			_, derr := c.Dialer()
			require.Equal(t, err.Error(), derr.Error(), "Dialer validates")
			_, terr := c.Transport()
			require.Equal(t, err.Error(), terr.Error(), "Transport validates")
		})
	}

	t.Run("valid", func(t *testing.T) {
		t.Parallel()
		c := ok()
		require.NoError(t, c.Validate())
		c.TLS, c.AllowPlaintextCredentials = nil, true
		require.NoError(t, c.Validate(), "credentials without TLS, when allowed")
		require.NoError(t, (&kafkaconfig.Config{Brokers: []string{"[::1]:9092", "kafka.example.com:9093"}}).Validate())
		require.NoError(t, (&kafkaconfig.Config{Brokers: []string{"k:1"}, TLS: &kafkaconfig.TLSConfig{}}).Validate(), "TLS with the system roots")
	})
	t.Run("every problem at once", func(t *testing.T) {
		t.Parallel()
		c := kafkaconfig.Config{Brokers: []string{"k1"}, SASL: sasl("plain", "", secret)}
		err := c.Validate()
		require.ErrorIs(t, err, kafkaconfig.ErrInvalidConfig)
		lines := strings.Split(err.Error(), "\n")
		require.Len(t, lines, 3, err.Error())
		require.Contains(t, lines[0], "Brokers[0]")
		require.Contains(t, lines[1], "SASL.Username")
		require.Contains(t, lines[2], "SASL: credentials would cross the network unencrypted")
		requireNoSecret(t, err.Error())
	})
	t.Run("nil", func(t *testing.T) {
		t.Parallel()
		var c *kafkaconfig.Config
		require.ErrorIs(t, c.Validate(), kafkaconfig.ErrInvalidConfig)
	})
}

func TestFromEnvErrorsNameTheVariable(t *testing.T) {
	t.Parallel()
	p := newPKI(t)
	base := map[string]string{
		"KAFKA_BROKERS":        "k1:9092,k2:9092",
		"KAFKA_TLS_CA_FILE":    p.caFile,
		"KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
		"KAFKA_SASL_USERNAME":  "app",
		"KAFKA_SASL_PASSWORD":  secret,
	}
	tests := []struct {
		name string
		vars map[string]string // added to base; "" deletes
		want string
		is   error
	}{
		{"unknown mechanism", map[string]string{"KAFKA_SASL_MECHANISM": "X"},
			`kafkaconfig: KAFKA_SASL_MECHANISM: unknown mechanism "X" (want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)`, nil},
		{"no brokers in the list", map[string]string{"KAFKA_BROKERS": " , "}, "kafkaconfig: KAFKA_BROKERS: no brokers (want at least one host:port)", nil},
		{"broker without port", map[string]string{"KAFKA_BROKERS": "k1:9092,k2"}, `kafkaconfig: KAFKA_BROKERS: "k2" is not host:port: missing port in address`, nil},
		{"brokers unset but a password set", map[string]string{"KAFKA_BROKERS": ""},
			"kafkaconfig: KAFKA_BROKERS: not set, while other KAFKA_ variables are (KAFKA_TLS_CA_FILE, KAFKA_SASL_MECHANISM, KAFKA_SASL_USERNAME, KAFKA_SASL_PASSWORD): set the brokers, or unset the rest", nil},
		{"no mechanism", map[string]string{"KAFKA_SASL_MECHANISM": ""},
			"kafkaconfig: KAFKA_SASL_MECHANISM: required when any KAFKA_SASL_ variable is set (want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)", nil},
		{"no username", map[string]string{"KAFKA_SASL_USERNAME": ""}, "kafkaconfig: KAFKA_SASL_USERNAME: required when any KAFKA_SASL_ variable is set", nil},
		{"no password", map[string]string{"KAFKA_SASL_PASSWORD": ""}, "kafkaconfig: KAFKA_SASL_PASSWORD: required when any KAFKA_SASL_ variable is set", nil},
		{"credentials without TLS", map[string]string{"KAFKA_TLS_CA_FILE": ""},
			"kafkaconfig: KAFKA_SASL_MECHANISM: credentials would cross the network unencrypted: set KAFKA_TLS_ENABLED=true (or a KAFKA_TLS_ file), or KAFKA_ALLOW_PLAINTEXT_CREDENTIALS=true to permit it", nil},
		{"missing CA file", map[string]string{"KAFKA_TLS_CA_FILE": "/nonexistent/ca.pem"},
			"kafkaconfig: KAFKA_TLS_CA_FILE: read CA certificates: open /nonexistent/ca.pem: no such file or directory", fs.ErrNotExist},
		{"CA file not PEM", map[string]string{"KAFKA_TLS_CA_FILE": p.garbageFile}, "kafkaconfig: KAFKA_TLS_CA_FILE: " + p.garbageFile + " holds no PEM certificate", nil},
		{"certificate without key", map[string]string{"KAFKA_TLS_CERT_FILE": p.clientCertFile},
			"kafkaconfig: KAFKA_TLS_KEY_FILE: required with KAFKA_TLS_CERT_FILE (the client certificate's private key)", nil},
		{"key without certificate", map[string]string{"KAFKA_TLS_KEY_FILE": p.clientKeyFile},
			"kafkaconfig: KAFKA_TLS_CERT_FILE: required with KAFKA_TLS_KEY_FILE (the client certificate)", nil},
		{"key of another certificate", map[string]string{"KAFKA_TLS_CERT_FILE": p.clientCertFile, "KAFKA_TLS_KEY_FILE": p.otherKeyFile},
			"kafkaconfig: KAFKA_TLS_KEY_FILE: " + p.otherKeyFile + " with the certificate in " + p.clientCertFile + ": tls: private key does not match public key", nil},
		{"not a boolean", map[string]string{"KAFKA_TLS_INSECURE_SKIP_VERIFY": "yes"},
			`kafkaconfig: KAFKA_TLS_INSECURE_SKIP_VERIFY: "yes" is not a boolean (want true or false)`, nil},
		{"plaintext flag not a boolean", map[string]string{"KAFKA_ALLOW_PLAINTEXT_CREDENTIALS": "sure"},
			`kafkaconfig: KAFKA_ALLOW_PLAINTEXT_CREDENTIALS: "sure" is not a boolean (want true or false)`, nil},
		{"TLS off but configured", map[string]string{"KAFKA_TLS_ENABLED": "false"},
			"kafkaconfig: KAFKA_TLS_ENABLED: false, but other KAFKA_TLS_ variables are set", nil},
		{"password as the mechanism", map[string]string{"KAFKA_SASL_MECHANISM": secret},
			`kafkaconfig: KAFKA_SASL_MECHANISM: unknown mechanism "[redacted]"`, nil},
		{"password in a boolean", map[string]string{"KAFKA_ALLOW_PLAINTEXT_CREDENTIALS": secret},
			`kafkaconfig: KAFKA_ALLOW_PLAINTEXT_CREDENTIALS: "[redacted]" is not a boolean`, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c, err := kafkaconfig.FromEnv(env(with(base, tt.vars)))
			require.Nil(t, c)
			require.Error(t, err)
			require.ErrorIs(t, err, kafkaconfig.ErrInvalidConfig)
			require.Contains(t, err.Error(), tt.want)
			require.NotContains(t, err.Error(), "\n", "one problem, one line")
			if tt.is != nil {
				require.ErrorIs(t, err, tt.is)
			}
			requireNoSecret(t, err.Error())
		})
	}
}

func TestFromEnv(t *testing.T) {
	t.Parallel()
	p := newPKI(t)

	t.Run("nothing set", func(t *testing.T) {
		t.Parallel()
		c, err := kafkaconfig.FromEnv(env(map[string]string{"KAFKA_BROKERS": "  ", "OTHER": "x"}))
		require.NoError(t, err)
		require.Nil(t, c, "no cluster configured: the caller decides")
	})
	t.Run("every variable", func(t *testing.T) {
		t.Parallel()
		c, err := kafkaconfig.FromEnv(env(map[string]string{
			"KAFKA_BROKERS":                     " k1:9092, k2:9093 ,",
			"KAFKA_CLIENT_ID":                   "payments",
			"KAFKA_TLS_ENABLED":                 "true",
			"KAFKA_TLS_CA_FILE":                 p.caFile,
			"KAFKA_TLS_CERT_FILE":               p.clientCertFile,
			"KAFKA_TLS_KEY_FILE":                p.clientKeyFile,
			"KAFKA_TLS_SERVER_NAME":             "kafka.internal",
			"KAFKA_TLS_INSECURE_SKIP_VERIFY":    "false",
			"KAFKA_SASL_MECHANISM":              "scram-sha-512",
			"KAFKA_SASL_USERNAME":               "app",
			"KAFKA_SASL_PASSWORD":               " " + secret, // kept as it is
			"KAFKA_ALLOW_PLAINTEXT_CREDENTIALS": "0",
		}))
		require.NoError(t, err)
		require.Equal(t, &kafkaconfig.Config{
			Brokers:  []string{"k1:9092", "k2:9093"},
			ClientID: "payments",
			TLS: &kafkaconfig.TLSConfig{CAFile: p.caFile, CertFile: p.clientCertFile, KeyFile: p.clientKeyFile,
				ServerName: "kafka.internal"},
			SASL: &kafkaconfig.SASLConfig{Mechanism: "scram-sha-512", Username: "app", Password: " " + secret},
		}, c)
	})
	t.Run("brokers only", func(t *testing.T) {
		t.Parallel()
		c, err := kafkaconfig.FromEnv(env(map[string]string{"KAFKA_BROKERS": "localhost:9092"}))
		require.NoError(t, err)
		require.Equal(t, &kafkaconfig.Config{Brokers: []string{"localhost:9092"}}, c)
	})
	t.Run("TLS with the system roots", func(t *testing.T) {
		t.Parallel()
		c, err := kafkaconfig.FromEnv(env(map[string]string{"KAFKA_BROKERS": "k:9092", "KAFKA_TLS_ENABLED": "TRUE",
			"KAFKA_SASL_MECHANISM": "PLAIN", "KAFKA_SASL_USERNAME": "app", "KAFKA_SASL_PASSWORD": secret}))
		require.NoError(t, err)
		require.Equal(t, &kafkaconfig.TLSConfig{}, c.TLS)
		d, err := c.Dialer()
		require.NoError(t, err)
		require.Nil(t, d.TLS.RootCAs, "nil RootCAs: the system's roots")
	})
	t.Run("plaintext credentials when allowed", func(t *testing.T) {
		t.Parallel()
		c, err := kafkaconfig.FromEnv(env(map[string]string{"KAFKA_BROKERS": "localhost:9092", "KAFKA_ALLOW_PLAINTEXT_CREDENTIALS": "true",
			"KAFKA_SASL_MECHANISM": "PLAIN", "KAFKA_SASL_USERNAME": "app", "KAFKA_SASL_PASSWORD": secret}))
		require.NoError(t, err)
		require.Nil(t, c.TLS)
		require.True(t, c.AllowPlaintextCredentials)
	})
	t.Run("nil getenv", func(t *testing.T) {
		t.Parallel()
		_, err := kafkaconfig.FromEnv(nil)
		require.ErrorIs(t, err, kafkaconfig.ErrInvalidConfig)
	})
}

func TestPasswordIsNeverShown(t *testing.T) {
	t.Parallel()
	c := &kafkaconfig.Config{Brokers: []string{"k1:9092"}, ClientID: "payments", TLS: &kafkaconfig.TLSConfig{ServerName: "kafka"},
		SASL: &kafkaconfig.SASLConfig{Mechanism: "SCRAM-SHA-256", Username: "app", Password: secret}}
	want := `kafkaconfig.Config{Brokers: ["k1:9092"], ClientID: "payments", ` +
		`TLS: {CAFile: "", CertFile: "", KeyFile: "", ServerName: "kafka", InsecureSkipVerify: false}, ` +
		`SASL: {Mechanism: "SCRAM-SHA-256", Username: "app", Password: [redacted]}}`
	require.Equal(t, want, c.String())
	for _, format := range []string{"%s", "%v", "%+v", "%#v"} {
		for _, v := range []any{c, *c, c.SASL, *c.SASL} {
			out := fmt.Sprintf(format, v)
			requireNoSecret(t, out)
			require.Contains(t, out, "[redacted]", "%s of %T", format, v)
		}
	}
	var logs bytes.Buffer
	slog.New(slog.NewJSONHandler(&logs, nil)).Info("kafka", "config", c, "sasl", c.SASL, "value", *c)
	slog.New(slog.NewTextHandler(&logs, nil)).Info("kafka", "config", c, "sasl", c.SASL, "value", *c)
	requireNoSecret(t, logs.String())
	require.Equal(t, 6, strings.Count(logs.String(), "[redacted]"), logs.String())

	// The mechanisms a dialer carries do not show it either (except
	// kafka-go's plain.Mechanism, a struct of its own).
	d, err := c.Dialer()
	require.NoError(t, err)
	for _, format := range []string{"%v", "%+v", "%#v"} {
		requireNoSecret(t, fmt.Sprintf(format, d.SASLMechanism))
	}
}

func TestDialerAndTransportCarryTLS(t *testing.T) {
	t.Parallel()
	p := newPKI(t)
	c := &kafkaconfig.Config{Brokers: []string{"127.0.0.1:9093"}, ClientID: "payments",
		TLS: &kafkaconfig.TLSConfig{CAFile: p.caFile, CertFile: p.clientCertFile, KeyFile: p.clientKeyFile, ServerName: "kafka.internal"}}
	d, err := c.Dialer()
	require.NoError(t, err)
	tr, err := c.Transport()
	require.NoError(t, err)
	defer tr.CloseIdleConnections()
	require.Equal(t, "payments", d.ClientID)
	require.Equal(t, "payments", tr.ClientID)
	require.Equal(t, kafkaconfig.DialTimeoutDefault, d.Timeout)
	require.Equal(t, kafkaconfig.DialTimeoutDefault, tr.DialTimeout)
	require.Nil(t, d.SASLMechanism)
	require.Nil(t, tr.SASL)

	for name, cfg := range map[string]*tls.Config{"dialer": d.TLS, "transport": tr.TLS} {
		require.NotNil(t, cfg, name)
		wantRoots := x509.NewCertPool()
		wantRoots.AddCert(p.caCert)
		require.True(t, cfg.RootCAs.Equal(wantRoots), "%s: RootCAs holds the CA, and only it", name)
		_, err := p.clientCert.Verify(x509.VerifyOptions{Roots: cfg.RootCAs, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
		require.NoError(t, err, "%s: a certificate the CA signed verifies against RootCAs", name)
		require.Len(t, cfg.Certificates, 1, name)
		require.Equal(t, p.clientCert.Raw, cfg.Certificates[0].Certificate[0], "%s: the client certificate", name)
		require.NotNil(t, cfg.Certificates[0].PrivateKey, name)
		require.Equal(t, "kafka.internal", cfg.ServerName, name)
		require.False(t, cfg.InsecureSkipVerify, name)
		require.Equal(t, uint16(tls.VersionTLS12), cfg.MinVersion, name)
	}
}

func TestSASLMechanismTypes(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct{ mechanism, name string }{
		{"PLAIN", "PLAIN"},
		{"plain", "PLAIN"},
		{"SCRAM-SHA-256", "SCRAM-SHA-256"},
		{"SCRAM-SHA-512", "SCRAM-SHA-512"},
		{" scram-sha-512 ", "SCRAM-SHA-512"},
	} {
		c := &kafkaconfig.Config{Brokers: []string{"k:9092"}, AllowPlaintextCredentials: true,
			SASL: &kafkaconfig.SASLConfig{Mechanism: tt.mechanism, Username: "app", Password: secret}}
		d, err := c.Dialer()
		require.NoError(t, err, tt.mechanism)
		tr, err := c.Transport()
		require.NoError(t, err, tt.mechanism)
		require.Nil(t, d.TLS)
		require.Equal(t, tt.name, d.SASLMechanism.Name(), tt.mechanism)
		require.Equal(t, tt.name, tr.SASL.Name(), tt.mechanism)
		if tt.name == "PLAIN" {
			require.Equal(t, plain.Mechanism{Username: "app", Password: secret}, d.SASLMechanism, "kafka-go's sasl/plain")
			require.Equal(t, d.SASLMechanism, tr.SASL)
		}
	}
}
