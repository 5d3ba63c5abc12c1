package natsbus

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/wire"
)

// KeyHeader carries a message's key, which NATS messages do not have. A
// [Reader] moves it back into kafka.Message.Key and leaves it out of the
// headers; a message without it has a nil key.
const KeyHeader = "sagaflow-key"

// msgIDHeader is the header JetStream deduplicates on.
const msgIDHeader = "Nats-Msg-Id"

// MetadataTTLDefault is how long a [Writer] trusts what it learnt about a
// topic's stream (whether it exists, how many partitions it has).
const MetadataTTLDefault = 30 * time.Second

// WriterOpts configures [NewWriter]. A nil *WriterOpts, and every zero
// field, means the default.
type WriterOpts struct {
	// MetadataTTL is how long the writer trusts what it learnt about a
	// topic's stream. A topic whose stream was missing is looked up again
	// after it. Defaults to MetadataTTLDefault.
	MetadataTTL time.Duration
}

// Writer publishes kafka.Messages to JetStream: it implements
// relay.Writer, so a relay can publish an outbox to NATS.
//
// Each message goes to the subject topic.<partition> of its topic's
// stream, the partition chosen from its key as Kafka's Java client does
// ([wire.Partition], murmur2) over the stream's partitions. Its headers
// are copied, its key travels in [KeyHeader], and its
// sagaflow-message-id header becomes Nats-Msg-Id, so the stream stores a
// message published again within its deduplication window once.
//
// WriteMessages publishes every message before it waits for the
// acknowledgements, and returns once the stream acknowledged each one
// (nil), or with kafka.WriteErrors whose entries are [relay.PublishError]s:
//
//   - no stream for the topic: a plain failure (the row spends an attempt,
//     and is parked after the relay's MaxAttempts);
//   - the server cannot be reached or did not answer in time, or no stream
//     answered (no responders): an outage (the row waits, spending nothing);
//   - a message larger than the server's max_payload or the stream's
//     MaxMsgSize: permanent, code relay.CodeTooLarge;
//   - a topic that cannot be a subject: permanent, relay.CodeInvalidTopic;
//   - a header NATS cannot carry as it is (a name that is not a token, a
//     value with CR or LF or surrounding blanks, a name that starts with
//     "Nats-" and would steer the server, or KeyHeader itself): permanent,
//     relay.CodeMalformedHeaders.
//
// The connection is the caller's: Close does not close it. Create the
// JetStream context with jetstream.WithPublishAsyncTimeout, so that an
// acknowledgement the server never sends is given up.
type Writer struct {
	js     jetstream.JetStream
	ttl    time.Duration
	closed atomic.Bool

	mu     sync.Mutex
	topics map[string]topicInfo
}

type topicInfo struct {
	partitions int
	err        error // why the topic cannot be published to now
	at         time.Time
}

var _ relay.Writer = (*Writer)(nil)

// NewWriter returns a writer that publishes through js.
func NewWriter(js jetstream.JetStream, opts *WriterOpts) (*Writer, error) {
	var o WriterOpts
	if opts != nil {
		o = *opts
	}
	if js == nil {
		return nil, fmt.Errorf("%w: js is nil", ErrInvalidConfig)
	}
	if o.MetadataTTL < 0 {
		return nil, fmt.Errorf("%w: MetadataTTL must not be negative", ErrInvalidConfig)
	}
	setDefault(&o.MetadataTTL, MetadataTTLDefault)
	return &Writer{js: js, ttl: o.MetadataTTL, topics: map[string]topicInfo{}}, nil
}

// ErrClosed is returned by a closed [Writer] or [Reader].
var ErrClosed = errors.New("natsbus: closed")

// Close makes later writes fail; it does not close the connection.
func (w *Writer) Close() error {
	w.closed.Store(true)
	return nil
}

// WriteMessages publishes msgs and waits for the stream to acknowledge
// each one; see [Writer].
func (w *Writer) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	if w.closed.Load() {
		return ErrClosed
	}
	if len(msgs) == 0 {
		return nil
	}
	errs := make(kafka.WriteErrors, len(msgs))
	futures := make([]jetstream.PubAckFuture, len(msgs))
	for i := range msgs {
		m, err := w.natsMsg(ctx, &msgs[i])
		if err != nil {
			errs[i] = err
			continue
		}
		f, err := w.js.PublishMsgAsync(m)
		if err != nil {
			errs[i] = publishError(msgs[i].Topic, err)
			continue
		}
		futures[i] = f
	}
	for i, f := range futures {
		if f == nil {
			continue
		}
		select {
		case <-f.Ok():
		case err := <-f.Err():
			errs[i] = publishError(msgs[i].Topic, err)
		case <-ctx.Done():
			errs[i] = &relay.PublishError{Outage: true, Err: fmt.Errorf("natsbus: no acknowledgement from the stream of topic %s: %w", msgs[i].Topic, ctx.Err())}
		}
	}
	for _, err := range errs {
		if err != nil {
			return errs
		}
	}
	return nil
}

// natsMsg builds the NATS message of m, or says why m cannot be published.
func (w *Writer) natsMsg(ctx context.Context, m *kafka.Message) (*nats.Msg, error) {
	if p := subjectProblem(m.Topic); p != "" {
		return nil, &relay.PublishError{Permanent: true, Code: relay.CodeInvalidTopic,
			Err: fmt.Errorf("natsbus: topic %q %s", safetext.Text(m.Topic, 256), p)}
	}
	n, err := w.partitions(ctx, m.Topic)
	if err != nil {
		return nil, err
	}
	out := &nats.Msg{Subject: Subject(m.Topic, wire.Partition(m.Key, n)), Data: m.Value, Header: nats.Header{}}
	if out.Data == nil {
		out.Data = []byte{}
	}
	for _, h := range m.Headers {
		if p := headerProblem(h.Key, string(h.Value)); p != "" {
			return nil, malformed(m.Topic, p)
		}
		if h.Key == wire.HeaderMessageID {
			out.Header.Set(msgIDHeader, string(h.Value))
		}
		out.Header.Add(h.Key, string(h.Value))
	}
	if m.Key != nil {
		if p := valueProblem(string(m.Key)); p != "" {
			return nil, malformed(m.Topic, "the key "+p)
		}
		out.Header.Set(KeyHeader, string(m.Key))
	}
	return out, nil
}

func malformed(topic, problem string) error {
	return &relay.PublishError{Permanent: true, Code: relay.CodeMalformedHeaders,
		Err: fmt.Errorf("natsbus: a message to topic %s cannot travel over NATS: %s", topic, problem)}
}

// headerProblem says why a header cannot travel as it is in a NATS
// message, or "".
func headerProblem(name, value string) string {
	switch {
	case name == "":
		return "a header has an empty name"
	case strings.EqualFold(name, KeyHeader):
		return fmt.Sprintf("header %q is where natsbus carries the key", name)
	case len(name) >= 5 && strings.EqualFold(name[:5], "Nats-"):
		return fmt.Sprintf("header %q: names starting with Nats- are read by the NATS server", safetext.Text(name, 256))
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c <= ' ' || c >= 0x7f || c == ':' {
			return fmt.Sprintf("header name %q holds a byte NATS header names cannot (space, control, ':' or non-ASCII)", safetext.Text(name, 256))
		}
	}
	if p := valueProblem(value); p != "" {
		return fmt.Sprintf("header %q %s", safetext.Text(name, 256), p)
	}
	return ""
}

// valueProblem says why a header value would not arrive as it was sent
// (NATS turns CR and LF into spaces and trims blanks), or "".
func valueProblem(v string) string {
	if strings.ContainsAny(v, "\r\n") {
		return "holds a CR or LF"
	}
	if v != strings.Trim(v, " \t") {
		return "starts or ends with a space or a tab"
	}
	return ""
}

// partitions returns how many partitions topic's stream has, from the
// cache when it is fresh.
func (w *Writer) partitions(ctx context.Context, topic string) (int, error) {
	w.mu.Lock()
	ti, ok := w.topics[topic]
	w.mu.Unlock()
	if ok && time.Since(ti.at) < w.ttl {
		return ti.partitions, ti.err
	}
	s, err := w.js.Stream(ctx, StreamName(topic))
	var n int
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		err = &relay.PublishError{Err: fmt.Errorf("natsbus: no stream %s for topic %s: create it with natsbus.Setup", StreamName(topic), topic)}
	case err != nil:
		// The lookup failed for a reason that is not this topic's: not
		// cached, so the next batch asks again.
		return 0, publishError(topic, fmt.Errorf("natsbus: look up stream %s of topic %s: %w", StreamName(topic), topic, err))
	default:
		if n, err = partitionsOf(topic, s.CachedInfo().Config.Subjects); err != nil {
			err = &relay.PublishError{Err: fmt.Errorf("natsbus: %w", err)}
		}
	}
	w.mu.Lock()
	w.topics[topic] = topicInfo{partitions: n, err: err, at: time.Now()}
	w.mu.Unlock()
	return n, err
}

// publishError says what a failed publish to topic means for its row.
func publishError(topic string, err error) error {
	var pub *relay.PublishError
	if errors.As(err, &pub) {
		return err
	}
	wrap := func(e error) error {
		if strings.Contains(e.Error(), topic) {
			return e
		}
		return fmt.Errorf("natsbus: publish to topic %s: %w", topic, e)
	}
	var api *jetstream.APIError
	switch {
	case errors.Is(err, nats.ErrMaxPayload),
		errors.As(err, &api) && api.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum:
		return &relay.PublishError{Permanent: true, Code: relay.CodeTooLarge, Err: wrap(err)}
	case errors.Is(err, nats.ErrBadSubject):
		return &relay.PublishError{Permanent: true, Code: relay.CodeInvalidTopic, Err: wrap(err)}
	case errors.Is(err, nats.ErrBadHeaderMsg):
		return &relay.PublishError{Permanent: true, Code: relay.CodeMalformedHeaders, Err: wrap(err)}
	case outage(err):
		return &relay.PublishError{Outage: true, Err: wrap(err)}
	}
	return &relay.PublishError{Err: wrap(err)}
}

// outage reports whether err says the server could not be reached or
// could not answer now, as opposed to refusing a message.
func outage(err error) bool {
	for _, target := range []error{
		context.DeadlineExceeded, context.Canceled,
		nats.ErrConnectionClosed, nats.ErrConnectionDraining, nats.ErrConnectionReconnecting, nats.ErrDisconnected,
		nats.ErrNoServers, nats.ErrTimeout, nats.ErrNoResponders, nats.ErrStaleConnection,
		jetstream.ErrNoStreamResponse, jetstream.ErrAsyncPublishTimeout, jetstream.ErrTooManyStalledMsgs,
		jetstream.ErrJetStreamNotEnabled, jetstream.ErrJetStreamNotEnabledForAccount, jetstream.ErrJetStreamPublisherClosed,
	} {
		if errors.Is(err, target) {
			return true
		}
	}
	var api *jetstream.APIError
	return errors.As(err, &api) && api.Code >= 500
}
