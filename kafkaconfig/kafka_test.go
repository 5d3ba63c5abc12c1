package kafkaconfig_test

import (
	"context"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/kafkaconfig"
)

// roundTrip writes a message to topic with a kafka.Writer on c's Dialer
// (as relay.NewKafkaWriter builds one) and another with a kafka.Writer on
// c's Transport, then reads both back with a kafka.Reader on c's Dialer.
func roundTrip(t *testing.T, c *kafkaconfig.Config, topic string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	d, err := c.Dialer()
	require.NoError(t, err)

	w := kafka.NewWriter(kafka.WriterConfig{
		Brokers: c.Brokers, Dialer: d, Topic: topic,
		BatchTimeout: 5 * time.Millisecond, RequiredAcks: int(kafka.RequireAll),
	})
	err = w.WriteMessages(ctx, kafka.Message{Key: []byte("k"), Value: []byte("through the dialer")})
	require.NoError(t, w.Close())
	require.NoError(t, err, "write through the dialer")

	tr, err := c.Transport()
	require.NoError(t, err)
	tw := &kafka.Writer{
		Addr: kafka.TCP(c.Brokers...), Transport: tr, Topic: topic,
		BatchTimeout: 5 * time.Millisecond, RequiredAcks: kafka.RequireAll,
	}
	err = tw.WriteMessages(ctx, kafka.Message{Key: []byte("k"), Value: []byte("through the transport")})
	require.NoError(t, tw.Close())
	tr.CloseIdleConnections() // a writer does not close a transport it was given
	require.NoError(t, err, "write through the transport")

	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers: c.Brokers, Dialer: d, Topic: topic, Partition: 0, MaxWait: 50 * time.Millisecond,
	})
	defer func() { require.NoError(t, r.Close()) }()
	var got []string
	for range 2 {
		m, err := r.ReadMessage(ctx)
		require.NoError(t, err, "read")
		got = append(got, string(m.Value))
	}
	require.Equal(t, []string{"through the dialer", "through the transport"}, got)
}

func TestDialerAndTransportReachACluster(t *testing.T) {
	t.Parallel()
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, "orders"))
	c := &kafkaconfig.Config{Brokers: kc.Addrs(), ClientID: "sagaflow-test"}
	roundTrip(t, c, "orders")
}

// TestTLSAndSASLReachACluster connects with each mechanism, over mutual
// TLS, to a kfake cluster that checks both: the SCRAM client against an
// independent server implementation.
func TestTLSAndSASLReachACluster(t *testing.T) {
	t.Parallel()
	p := newPKI(t)
	const scramUser = "app,team=payments" // escaped in SCRAM as app=2Cteam=3Dpayments
	kc, err := kfake.NewCluster(
		kfake.NumBrokers(1),
		kfake.TLS(p.serverTLS()),
		kfake.EnableSASL(),
		kfake.Superuser("PLAIN", "plain-app", secret),
		kfake.Superuser("SCRAM-SHA-256", scramUser, secret),
		kfake.Superuser("SCRAM-SHA-512", scramUser, secret+"-512"),
		kfake.SeedTopics(1, "plain", "scram-256", "scram-512"),
	)
	require.NoError(t, err)
	t.Cleanup(kc.Close)
	brokers := kc.ListenAddrs()
	mTLS := &kafkaconfig.TLSConfig{CAFile: p.caFile, CertFile: p.clientCertFile, KeyFile: p.clientKeyFile}
	config := func(mechanism, user, password string) *kafkaconfig.Config {
		return &kafkaconfig.Config{Brokers: brokers, TLS: mTLS,
			SASL: &kafkaconfig.SASLConfig{Mechanism: mechanism, Username: user, Password: password}}
	}

	for _, tt := range []struct{ mechanism, user, password, topic string }{
		{"PLAIN", "plain-app", secret, "plain"},
		{"SCRAM-SHA-256", scramUser, secret, "scram-256"},
		{"SCRAM-SHA-512", scramUser, secret + "-512", "scram-512"},
	} {
		t.Run(tt.mechanism, func(t *testing.T) {
			t.Parallel()
			roundTrip(t, config(tt.mechanism, tt.user, tt.password), tt.topic)
		})
	}

	refused := func(t *testing.T, c *kafkaconfig.Config) error {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		d, err := c.Dialer()
		require.NoError(t, err)
		conn, err := d.DialContext(ctx, "tcp", brokers[0])
		if err == nil {
			_ = conn.Close()
		}
		require.Error(t, err, "the cluster accepted the connection")
		return err
	}
	for _, mechanism := range []string{"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"} {
		t.Run("wrong password/"+mechanism, func(t *testing.T) {
			t.Parallel()
			user := scramUser
			if mechanism == "PLAIN" {
				user = "plain-app"
			}
			err := refused(t, config(mechanism, user, secret+"-wrong"))
			require.ErrorContains(t, err, "SASL Authentication Failed")
			requireNoSecret(t, err.Error())
		})
	}
	t.Run("no client certificate", func(t *testing.T) {
		t.Parallel()
		c := config("PLAIN", "plain-app", secret)
		c.TLS = &kafkaconfig.TLSConfig{CAFile: p.caFile}
		require.ErrorContains(t, refused(t, c), "certificate required")
	})
	t.Run("CA that did not sign the brokers", func(t *testing.T) {
		t.Parallel()
		other := newPKI(t)
		c := config("PLAIN", "plain-app", secret)
		c.TLS = &kafkaconfig.TLSConfig{CAFile: other.caFile, CertFile: p.clientCertFile, KeyFile: p.clientKeyFile}
		err := refused(t, c)
		require.ErrorContains(t, err, "certificate signed by unknown authority")
	})
	t.Run("server name the certificate is not for", func(t *testing.T) {
		t.Parallel()
		c := config("PLAIN", "plain-app", secret)
		c.TLS = &kafkaconfig.TLSConfig{CAFile: p.caFile, CertFile: p.clientCertFile, KeyFile: p.clientKeyFile, ServerName: "elsewhere"}
		err := refused(t, c)
		require.ErrorContains(t, err, "elsewhere")
	})
}
