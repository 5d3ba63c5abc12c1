package chaos

import (
	"log/slog"
	"os"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// AckTraceEnv, set to 1 in the environment of a NATS soak, makes each node
// log every acknowledgement its relays get from JetStream (the message id,
// subject, stream, sequence and whether the server saw it as a duplicate),
// to follow a message marked published that is missing from its stream.
const AckTraceEnv = "CHAOS_TRACE_ACKS"

// ackTracer is a JetStream context whose asynchronous publishes log their
// outcome.
type ackTracer struct {
	jetstream.JetStream
	log *slog.Logger
}

// traceAcks returns js, wrapped to log acknowledgements when AckTraceEnv
// asks for it.
func traceAcks(js jetstream.JetStream, log *slog.Logger) jetstream.JetStream {
	if os.Getenv(AckTraceEnv) != "1" {
		return js
	}
	return &ackTracer{JetStream: js, log: log}
}

func (t *ackTracer) PublishMsgAsync(m *nats.Msg, opts ...jetstream.PublishOpt) (jetstream.PubAckFuture, error) {
	f, err := t.JetStream.PublishMsgAsync(m, opts...)
	id := m.Header.Get("Nats-Msg-Id")
	if err != nil {
		t.log.Warn("chaos ack trace: publish refused", slog.String("id", id), slog.String("subject", m.Subject), slog.String("error", err.Error()))
		return f, err
	}
	// The outcome goes to the log and then to the caller, through channels
	// of the traced future's own: both cannot read the original's.
	tf := &tracedFuture{PubAckFuture: f, ok: make(chan *jetstream.PubAck, 1), err: make(chan error, 1)}
	go func() {
		select {
		case a := <-f.Ok():
			t.log.Warn("chaos ack trace: acknowledged", slog.String("id", id), slog.String("subject", m.Subject),
				slog.String("stream", a.Stream), slog.Uint64("seq", a.Sequence), slog.Bool("duplicate", a.Duplicate))
			tf.ok <- a
		case err := <-f.Err():
			t.log.Warn("chaos ack trace: failed", slog.String("id", id), slog.String("subject", m.Subject), slog.String("error", err.Error()))
			tf.err <- err
		}
	}()
	return tf, nil
}

// tracedFuture hands on what its original future resolved to.
type tracedFuture struct {
	jetstream.PubAckFuture
	ok  chan *jetstream.PubAck
	err chan error
}

func (f *tracedFuture) Ok() <-chan *jetstream.PubAck { return f.ok }
func (f *tracedFuture) Err() <-chan error            { return f.err }
