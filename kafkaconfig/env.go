package kafkaconfig

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Environment variables read by [FromEnv].
const (
	EnvBrokers                   = "KAFKA_BROKERS"
	EnvClientID                  = "KAFKA_CLIENT_ID"
	EnvTLSEnabled                = "KAFKA_TLS_ENABLED"
	EnvTLSCAFile                 = "KAFKA_TLS_CA_FILE"
	EnvTLSCertFile               = "KAFKA_TLS_CERT_FILE"
	EnvTLSKeyFile                = "KAFKA_TLS_KEY_FILE"
	EnvTLSServerName             = "KAFKA_TLS_SERVER_NAME"
	EnvTLSInsecureSkipVerify     = "KAFKA_TLS_INSECURE_SKIP_VERIFY"
	EnvSASLMechanism             = "KAFKA_SASL_MECHANISM"
	EnvSASLUsername              = "KAFKA_SASL_USERNAME"
	EnvSASLPassword              = "KAFKA_SASL_PASSWORD"
	EnvAllowPlaintextCredentials = "KAFKA_ALLOW_PLAINTEXT_CREDENTIALS"
)

// FromEnv reads a [Config] from environment variables through getenv
// (os.Getenv in a program, a map lookup in a test) and validates it; see
// the package documentation for the variables.
//
// It returns nil and no error when KAFKA_BROKERS is empty or unset and no
// other KAFKA_ variable of the table is set: no cluster is configured, and
// the caller decides what that means. When another one is set (a password,
// say) without KAFKA_BROKERS, FromEnv refuses it rather than let a
// misspelt KAFKA_BROKERS pass unnoticed.
//
// Errors name the variable, as in "kafkaconfig: KAFKA_SASL_MECHANISM:
// unknown mechanism ...", match [ErrInvalidConfig], and never contain the
// password.
func FromEnv(getenv func(string) string) (*Config, error) {
	if getenv == nil {
		return nil, &configError{msg: "kafkaconfig: getenv is nil (pass os.Getenv)"}
	}
	get := func(key string) string { return strings.TrimSpace(getenv(key)) }
	password := getenv(EnvSASLPassword) // as it is: spaces may be part of it

	brokersVar := get(EnvBrokers)
	if brokersVar == "" {
		var set []string
		for _, key := range []string{EnvClientID, EnvTLSEnabled, EnvTLSCAFile, EnvTLSCertFile, EnvTLSKeyFile, EnvTLSServerName,
			EnvTLSInsecureSkipVerify, EnvSASLMechanism, EnvSASLUsername, EnvSASLPassword, EnvAllowPlaintextCredentials} {
			if get(key) != "" {
				set = append(set, key)
			}
		}
		if len(set) == 0 {
			return nil, nil
		}
		return nil, &configError{msg: fmt.Sprintf("kafkaconfig: %s: not set, while other KAFKA_ variables are (%s): set the brokers, or unset the rest",
			EnvBrokers, strings.Join(set, ", "))}
	}

	c := &Config{ClientID: get(EnvClientID)}
	for b := range strings.SplitSeq(brokersVar, ",") {
		if b = strings.TrimSpace(b); b != "" {
			c.Brokers = append(c.Brokers, b)
		}
	}

	var errs []error
	boolVar := func(key string) bool {
		v := get(key)
		if v == "" {
			return false
		}
		on, err := strconv.ParseBool(v)
		if err != nil {
			errs = append(errs, &configError{msg: fmt.Sprintf("kafkaconfig: %s: %q is not a boolean (want true or false)", key, redact(v, password))})
		}
		return on
	}

	tlsOn := boolVar(EnvTLSEnabled)
	t := TLSConfig{
		CAFile:             get(EnvTLSCAFile),
		CertFile:           get(EnvTLSCertFile),
		KeyFile:            get(EnvTLSKeyFile),
		ServerName:         get(EnvTLSServerName),
		InsecureSkipVerify: boolVar(EnvTLSInsecureSkipVerify),
	}
	if t != (TLSConfig{}) {
		if get(EnvTLSEnabled) != "" && !tlsOn {
			errs = append(errs, &configError{msg: fmt.Sprintf("kafkaconfig: %s: false, but other KAFKA_TLS_ variables are set", EnvTLSEnabled)})
		}
		tlsOn = true
	}
	if tlsOn {
		c.TLS = &t
	}

	s := SASLConfig{Mechanism: get(EnvSASLMechanism), Username: get(EnvSASLUsername), Password: password}
	if s != (SASLConfig{}) {
		c.SASL = &s
	}
	c.AllowPlaintextCredentials = boolVar(EnvAllowPlaintextCredentials)

	if len(errs) == 1 {
		return nil, errs[0]
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if _, _, err := c.build(envNames); err != nil {
		return nil, err
	}
	return c, nil
}

type envNamer struct{}

var envNames namer = envNamer{}

func (envNamer) name(field string) string {
	switch field {
	case "Brokers":
		return EnvBrokers
	case "TLS.CAFile":
		return EnvTLSCAFile
	case "TLS.CertFile":
		return EnvTLSCertFile
	case "TLS.KeyFile":
		return EnvTLSKeyFile
	case "SASL", "SASL.Mechanism":
		return EnvSASLMechanism
	case "SASL.Username":
		return EnvSASLUsername
	case "SASL.Password":
		return EnvSASLPassword
	}
	return field // not reached: every field that build names has a case above
}

func (envNamer) broker(int) string { return EnvBrokers }

func (envNamer) withSASL() string { return "required when any KAFKA_SASL_ variable is set" }

func (envNamer) noTLSHint() string {
	return "set " + EnvTLSEnabled + "=true (or a KAFKA_TLS_ file), or " + EnvAllowPlaintextCredentials + "=true to permit it"
}
