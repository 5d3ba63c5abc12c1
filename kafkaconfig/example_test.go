package kafkaconfig_test

import (
	"fmt"

	"github.com/sagaflow/sagaflow/kafkaconfig"
)

func ExampleFromEnv() {
	// In a program: kafkaconfig.FromEnv(os.Getenv).
	vars := map[string]string{
		"KAFKA_BROKERS":        "kafka-1.internal:9093,kafka-2.internal:9093",
		"KAFKA_TLS_ENABLED":    "true",
		"KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
		"KAFKA_SASL_USERNAME":  "payments",
		"KAFKA_SASL_PASSWORD":  "hunter2",
	}
	cfg, err := kafkaconfig.FromEnv(func(key string) string { return vars[key] })
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(cfg)
	dialer, err := cfg.Dialer() // for kafka.ReaderConfig.Dialer and relay.WriterOpts.Dialer
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(dialer.SASLMechanism.Name(), dialer.TLS != nil)

	vars["KAFKA_SASL_MECHANISM"] = "SCRAM-SHA-1"
	_, err = kafkaconfig.FromEnv(func(key string) string { return vars[key] })
	fmt.Println(err)
	// Output:
	// kafkaconfig.Config{Brokers: ["kafka-1.internal:9093" "kafka-2.internal:9093"], TLS: {CAFile: "", CertFile: "", KeyFile: "", ServerName: "", InsecureSkipVerify: false}, SASL: {Mechanism: "SCRAM-SHA-512", Username: "payments", Password: [redacted]}}
	// SCRAM-SHA-512 true
	// kafkaconfig: KAFKA_SASL_MECHANISM: unknown mechanism "SCRAM-SHA-1" (want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)
}
