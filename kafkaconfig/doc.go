// Package kafkaconfig says how sagaflow reaches a real Kafka cluster: the
// brokers, TLS and SASL, as a [Config] that becomes the dialer and transport
// kafka-go's readers and writers take.
//
// Library code never reads the environment; a program does, with
// [FromEnv]:
//
//	cfg, err := kafkaconfig.FromEnv(os.Getenv)
//	if err != nil {
//		return err // names the variable; never shows the password
//	}
//	if cfg == nil {
//		return errors.New("set KAFKA_BROKERS") // or start an in-process cluster, as sagaflow's demo does
//	}
//	slog.InfoContext(ctx, "kafka", slog.Any("config", cfg)) // the password shows as [redacted]
//	dialer, err := cfg.Dialer()
//	if err != nil {
//		return err
//	}
//
//	// Publish the outbox.
//	w := relay.NewKafkaWriter(cfg.Brokers, &relay.WriterOpts{Dialer: dialer})
//	defer w.Close() // after the relay's Stop
//	rl, err := relay.New(pool, w, &relay.Config{Schema: "sagaflow"})
//	if err != nil {
//		return err
//	}
//	if err := rl.Start(ctx); err != nil {
//		return err
//	}
//	defer rl.Stop(context.WithoutCancel(ctx))
//
//	// Consume, in a consumer group, deduplicated by the inbox.
//	r := kafka.NewReader(kafka.ReaderConfig{
//		Brokers: cfg.Brokers,
//		Dialer:  dialer,
//		GroupID: "payments",
//		Topic:   "payments",
//	})
//	defer r.Close()
//	in, err := inbox.New(pool, &inbox.Config{Consumer: "payments", Schema: "sagaflow"})
//	if err != nil {
//		return err
//	}
//	c, err := in.NewConsumer(r, &inbox.ConsumerConfig{
//		Handlers: map[string]inbox.HandlerFunc{"charge.requested": charge},
//	})
//	if err != nil {
//		return err
//	}
//	go c.Run(ctx)
//
// A kafka.Writer literal or a kafka.Client takes a transport instead:
// [Config.Transport]. Close it (CloseIdleConnections) after the writers
// that use it: a writer does not close a transport it was given.
//
// # Environment
//
// [FromEnv] reads these variables; surrounding spaces are ignored, except in
// the password. It returns nil and no error when none of them is set.
//
//	variable                            Config field                  value
//	KAFKA_BROKERS                       Brokers                       host:port,host:port (required)
//	KAFKA_CLIENT_ID                     ClientID                      the client id the brokers see
//	KAFKA_TLS_ENABLED                   TLS                           true: TLS with the system's roots
//	KAFKA_TLS_CA_FILE                   TLS.CAFile                    PEM file of the brokers' CA
//	KAFKA_TLS_CERT_FILE                 TLS.CertFile                  PEM file of a client certificate (mutual TLS)
//	KAFKA_TLS_KEY_FILE                  TLS.KeyFile                   PEM file of its private key
//	KAFKA_TLS_SERVER_NAME               TLS.ServerName                name the brokers' certificates are checked against
//	KAFKA_TLS_INSECURE_SKIP_VERIFY      TLS.InsecureSkipVerify        true: accept any certificate (tests only)
//	KAFKA_SASL_MECHANISM                SASL.Mechanism                PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512
//	KAFKA_SASL_USERNAME                 SASL.Username
//	KAFKA_SASL_PASSWORD                 SASL.Password
//	KAFKA_ALLOW_PLAINTEXT_CREDENTIALS   AllowPlaintextCredentials     true: permit SASL without TLS
//
// Any KAFKA_TLS_ variable turns TLS on; KAFKA_TLS_ENABLED=true alone turns it
// on for brokers whose certificates the system already trusts (most hosted
// clusters). Any KAFKA_SASL_ variable turns SASL on, and then all three are
// required. Booleans are true or false (or 1, 0, t, f, in any case).
//
// # Validation
//
// [Config.Validate] (which Dialer, Transport and FromEnv call) refuses: no
// brokers; a broker that is not host:port; a CA file that cannot be read or
// holds no PEM certificate; a client certificate without its key, or a key
// that cannot be read or does not match it; an unknown SASL mechanism; an
// empty username or password; and SASL credentials over a connection
// without TLS, unless AllowPlaintextCredentials says so. It reports every
// problem at once, each naming its field (with FromEnv, its variable), as
//
//	kafkaconfig: KAFKA_SASL_MECHANISM: unknown mechanism "X" (want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)
//
// Each error matches [ErrInvalidConfig]. The password is never in an
// error, nor in what String, GoString (%#v) or LogValue show.
//
// # SASL
//
// PLAIN is kafka-go's sasl/plain. SCRAM-SHA-256 and SCRAM-SHA-512 are this
// package's own client (RFC 5802 on the standard library's crypto), since
// kafka-go's sasl/scram would add three modules to sagaflow's dependencies.
// Like Kafka's Java client, it sends the credentials as UTF-8 without
// SASLprep, and it refuses a server that asks for fewer than 4096
// iterations or whose final signature does not prove it knows the
// credentials.
package kafkaconfig
