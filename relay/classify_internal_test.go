package relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
)

func TestClassify(t *testing.T) {
	t.Parallel()
	// As the relay wraps a message's error, and as kafka-go wraps a broker's
	// error code that came with a message.
	wrap := func(err error) error { return fmt.Errorf("relay: publish to orders: %w", err) }
	withText := func(code kafka.Error) error { return fmt.Errorf("%w: %s", code, "broker says so") }
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: &os.SyscallError{Syscall: "connect", Err: syscall.ECONNREFUSED}}
	reset := &net.OpError{Op: "read", Net: "tcp", Err: &os.SyscallError{Syscall: "read", Err: syscall.ECONNRESET}}

	for _, tc := range []struct {
		name  string
		err   error
		class errorClass
		code  string
	}{
		// Per-message refusals that can never pass.
		{"broker: message too large", wrap(withText(kafka.MessageSizeTooLarge)), classPermanent, CodeTooLarge},
		{"broker: record list too large", wrap(kafka.RecordListTooLarge), classPermanent, CodeTooLarge},
		{"kafka-go: larger than BatchBytes", wrap(kafka.MessageTooLargeError{}), classPermanent, CodeTooLarge},
		{"broker: invalid topic", wrap(kafka.InvalidTopic), classPermanent, CodeInvalidTopic},
		{"broker: invalid record", wrap(withText(kafka.InvalidRecord)), classPermanent, CodeRejected},

		// The broker is down or cannot take writes: no attempt spent.
		{"dial refused", refused, classOutage, ""},
		{"dial refused inside kafka-go's client", wrap(fmt.Errorf("kafka.(*Client).Produce: %w", refused)), classOutage, ""},
		{"connection reset", wrap(reset), classOutage, ""},
		{"connection closed mid-request", wrap(fmt.Errorf("kafka.(*Client).Produce: %w", io.ErrUnexpectedEOF)), classOutage, ""},
		{"EOF", io.EOF, classOutage, ""},
		{"use of closed connection", wrap(net.ErrClosed), classOutage, ""},
		{"bare errno", syscall.EHOSTUNREACH, classOutage, ""},
		{"DNS failure", &net.DNSError{Err: "no such host", Name: "kafka-0", IsNotFound: true}, classOutage, ""},
		{"PublishTimeout passed", wrap(context.DeadlineExceeded), classOutage, ""},
		{"leader not available", wrap(kafka.LeaderNotAvailable), classOutage, ""},
		{"not leader for partition", wrap(kafka.NotLeaderForPartition), classOutage, ""},
		{"not enough replicas", wrap(withText(kafka.NotEnoughReplicas)), classOutage, ""},
		{"not enough replicas after append", wrap(kafka.NotEnoughReplicasAfterAppend), classOutage, ""},
		{"request timed out", wrap(kafka.RequestTimedOut), classOutage, ""},
		{"network exception", wrap(kafka.NetworkException), classOutage, ""},
		{"broker not available", wrap(kafka.BrokerNotAvailable), classOutage, ""},
		{"replica not available", wrap(kafka.ReplicaNotAvailable), classOutage, ""},
		{"storage error", wrap(kafka.KafkaStorageError), classOutage, ""},
		{"throttled", wrap(kafka.ThrottlingQuotaExceeded), classOutage, ""},
		{"cluster authorization failed", wrap(kafka.ClusterAuthorizationFailed), classOutage, ""},
		{"SASL authentication failed", wrap(withText(kafka.SASLAuthenticationFailed)), classOutage, ""},

		// Neither: counted, parked after MaxAttempts.
		{"unknown topic", wrap(kafka.UnknownTopicOrPartition), classRetry, ""},
		{"unknown topic id", wrap(kafka.UnknownTopicID), classRetry, ""},
		{"corrupt message", wrap(kafka.InvalidMessage), classRetry, ""},
		{"topic authorization failed", wrap(kafka.TopicAuthorizationFailed), classRetry, ""},
		{"timestamp out of range", wrap(kafka.InvalidTimestamp), classRetry, ""},
		{"unknown server error", wrap(kafka.Unknown), classRetry, ""},
		{"writer closed", io.ErrClosedPipe, classRetry, ""},
		{"cancelled", context.Canceled, classRetry, ""},
		{"an error the relay does not know", errors.New("fake: cluster on fire"), classRetry, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			class, code := classify(tc.err)
			require.Equal(t, tc.class, class, "error %v", tc.err)
			require.Equal(t, tc.code, code)
		})
	}

	// Every Kafka error code satisfies net.Error (kafka.Error has Timeout
	// and Temporary): the code must win over the net.Error test.
	var ne net.Error
	require.ErrorAs(t, wrap(kafka.InvalidTopic), &ne)
}

// TestClassifyPublishError: a non-Kafka writer's own verdict decides, even
// wrapped, and a permanent one without a code parks as rejected.
func TestClassifyPublishError(t *testing.T) {
	cases := []struct {
		err   error
		class errorClass
		code  string
	}{
		{&PublishError{Permanent: true, Code: "http_410", Err: errors.New("gone")}, classPermanent, "http_410"},
		{fmt.Errorf("wrapped: %w", &PublishError{Permanent: true, Err: errors.New("x")}), classPermanent, CodeRejected},
		{&PublishError{Outage: true, Err: errors.New("503")}, classOutage, ""},
		{&PublishError{NotSent: true, Err: errors.New("behind a failure")}, classNotSent, ""},
		{&PublishError{Err: io.EOF}, classRetry, ""}, // its verdict wins over the EOF inside
	}
	for _, c := range cases {
		class, code := classify(c.err)
		if class != c.class || code != c.code {
			t.Errorf("classify(%v) = %v %q, want %v %q", c.err, class, code, c.class, c.code)
		}
	}
}
