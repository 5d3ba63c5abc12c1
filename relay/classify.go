package relay

import (
	"context"
	"errors"
	"io"
	"net"
	"syscall"

	"github.com/segmentio/kafka-go"
)

// errorClass is what a failed publish means for the row whose message it
// failed.
type errorClass int

const (
	// classRetry: the write may pass later for a reason this row cannot
	// know (an unknown topic that may yet be created, a denied ACL, an
	// error the relay does not recognise). The row spends an attempt and is
	// tried again after Backoff; MaxAttempts spent attempts park it.
	classRetry errorClass = iota
	// classOutage: the broker could not be reached or could not take writes
	// right now (a refused or reset connection, a timeout, no leader, too
	// few in-sync replicas). It says nothing about the row: the row spends
	// no attempt and waits, however long the outage lasts.
	classOutage
	// classPermanent: the broker refused this message for good (too large,
	// an illegal topic, a malformed record). Retrying can never succeed:
	// the row is parked at once.
	classPermanent
	// classNotSent: the writer held the message back behind a failed
	// earlier message of its key (see PublishError.NotSent).
	classNotSent
)

func (c errorClass) String() string {
	switch c {
	case classOutage:
		return "outage"
	case classPermanent:
		return "permanent"
	case classNotSent:
		return "not sent"
	default:
		return "retry"
	}
}

// classify decides what a failed write of one message means, and for a
// permanent failure the code its row is parked with. err is the message's
// own error (an entry of kafka.WriteErrors) or the error of the whole write.
//
// The order matters. kafka.Error has Timeout and Temporary methods, so every
// Kafka error code satisfies net.Error: the broker's answer is looked at
// first, and only an error that carries no Kafka code is judged as a
// connection error.
func classify(err error) (errorClass, string) {
	var pub *PublishError
	if errors.As(err, &pub) {
		switch {
		case pub.Permanent:
			if pub.Code == "" {
				return classPermanent, CodeRejected
			}
			return classPermanent, pub.Code
		case pub.Outage:
			return classOutage, ""
		case pub.NotSent:
			return classNotSent, ""
		}
		return classRetry, ""
	}
	var tooLarge kafka.MessageTooLargeError
	if errors.As(err, &tooLarge) {
		// kafka-go refused it before sending: larger than the writer's
		// BatchBytes.
		return classPermanent, CodeTooLarge
	}
	var code kafka.Error
	if errors.As(err, &code) {
		return classifyCode(code)
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		// PublishTimeout passed before the broker answered: a broker that
		// hangs is as down as one that refuses connections.
		return classOutage, ""
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, net.ErrClosed),
		errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.ECONNABORTED),
		errors.Is(err, syscall.EPIPE), errors.Is(err, syscall.ETIMEDOUT), errors.Is(err, syscall.EHOSTUNREACH),
		errors.Is(err, syscall.ENETUNREACH), errors.Is(err, syscall.EHOSTDOWN), errors.Is(err, syscall.ENETDOWN):
		// The connection was refused, cut or never answered (kafka-go
		// reports a connection closed mid-request as unexpected EOF).
		return classOutage, ""
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		// Dial, DNS and socket errors: *net.OpError, *net.DNSError.
		return classOutage, ""
	}
	return classRetry, ""
}

// classifyCode judges a Kafka error code from the broker.
func classifyCode(code kafka.Error) (errorClass, string) {
	switch code {
	case kafka.MessageSizeTooLarge, kafka.RecordListTooLarge:
		return classPermanent, CodeTooLarge
	case kafka.InvalidTopic:
		return classPermanent, CodeInvalidTopic
	case kafka.InvalidRecord:
		return classPermanent, CodeRejected
	case kafka.UnknownTopicOrPartition, kafka.UnknownTopicID, kafka.InconsistentTopicID:
		// Retriable to Kafka, but about this row's topic, not the cluster:
		// a topic that was never created would make its rows wait forever.
		return classRetry, ""
	case kafka.InvalidMessage:
		// CORRUPT_MESSAGE: a checksum that did not match. Usually damage in
		// transit, so retried, but it may be this message: counted.
		return classRetry, ""
	case kafka.BrokerNotAvailable, kafka.ReplicaNotAvailable:
		// Not marked retriable by kafka-go, but a broker that is down.
		return classOutage, ""
	case kafka.SASLAuthenticationFailed, kafka.ClusterAuthorizationFailed:
		// The cluster refuses this relay as a whole (credentials or ACLs
		// being changed): as unreachable as a broker that is down, and
		// nothing to do with any one row.
		return classOutage, ""
	}
	if code.Temporary() || code.Timeout() {
		// LEADER_NOT_AVAILABLE, NOT_LEADER_FOR_PARTITION, REQUEST_TIMED_OUT,
		// NETWORK_EXCEPTION, NOT_ENOUGH_REPLICAS(_AFTER_APPEND),
		// KAFKA_STORAGE_ERROR, THROTTLING_QUOTA_EXCEEDED and the like: the
		// cluster cannot take the write now.
		return classOutage, ""
	}
	return classRetry, ""
}
