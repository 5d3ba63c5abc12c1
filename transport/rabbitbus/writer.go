package rabbitbus

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/relay"
)

// MaxMessageBytesDefault bounds a message's body and headers: RabbitMQ 4's
// default max_message_size (3.x allowed 128 MiB).
const MaxMessageBytesDefault = 16 << 20

// WriterOpts configures [NewWriter]. A nil *WriterOpts, and every zero
// field, means the default.
type WriterOpts struct {
	Topology
	// MaxMessageBytes bounds a message's body and headers together; a
	// larger message is refused for good (relay.CodeTooLarge) before it is
	// sent. Keep it at most the broker's max_message_size. Defaults to
	// MaxMessageBytesDefault.
	MaxMessageBytes int
}

// Writer publishes to RabbitMQ; it implements relay.Writer, so a
// relay.Relay publishes an outbox through it. See the package documentation
// for the mapping. Its methods are safe for concurrent use; writes are
// serialised.
type Writer struct {
	dial DialFunc
	topo Topology
	max  int

	mu     sync.Mutex // one write at a time; guards pc and closed
	pc     *pubChannel
	closed bool
}

var _ relay.Writer = (*Writer)(nil)

// NewWriter returns a writer that connects with dial when it first writes,
// and again after its connection or channel was lost.
func NewWriter(dial DialFunc, opts *WriterOpts) (*Writer, error) {
	if dial == nil {
		return nil, fmt.Errorf("%w: dial is nil", ErrInvalidConfig)
	}
	var o WriterOpts
	if opts != nil {
		o = *opts
	}
	topo, err := o.Topology.withDefaults()
	if err != nil {
		return nil, err
	}
	if o.MaxMessageBytes < 0 {
		return nil, fmt.Errorf("%w: MaxMessageBytes must not be negative", ErrInvalidConfig)
	}
	if o.MaxMessageBytes == 0 {
		o.MaxMessageBytes = MaxMessageBytesDefault
	}
	return &Writer{dial: dial, topo: topo, max: o.MaxMessageBytes}, nil
}

// ErrClosed is returned by a closed [Writer] or [Reader].
var ErrClosed = errors.New("rabbitbus: closed")

// outgoing is one message of a batch, ready to publish.
type outgoing struct {
	i          int // index in the batch
	routingKey string
	pub        amqp.Publishing
}

// WriteMessages publishes msgs with publisher confirms and waits for the
// broker's answer to every one of them (publish all, then wait). It
// returns nil when the broker confirmed all of them, else
// kafka.WriteErrors with one entry per message (nil: confirmed), each a
// *relay.PublishError when it says more than "retry":
//
//   - a message the broker confirmed: nil;
//   - a message no queue is bound for (returned as unroutable, with
//     mandatory publishing), or one the broker nacked (a full queue with
//     reject-publish, say): an error to retry;
//   - a message that cannot be carried (an illegal topic, a header name
//     longer than 255 bytes, larger than MaxMessageBytes or than a frame
//     can hold for its headers): Permanent, with relay.CodeInvalidTopic,
//     relay.CodeTooLarge or relay.CodeRejected;
//   - a message whose answer never came because the connection or the
//     channel closed, the broker could not be reached, or ctx ended first:
//     Outage. The next write connects again.
func (w *Writer) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return ErrClosed
	}
	if len(msgs) == 0 {
		return nil
	}
	errs := make([]error, len(msgs))
	out := make([]outgoing, 0, len(msgs))
	for i := range msgs {
		o, err := w.prepare(&msgs[i])
		if err != nil {
			errs[i] = err
			continue
		}
		o.i = i
		out = append(out, o)
	}
	if len(out) > 0 {
		w.publish(ctx, out, errs)
	}
	for _, e := range errs {
		if e != nil {
			return kafka.WriteErrors(errs)
		}
	}
	return nil
}

// prepare turns m into a publishing, or says why it can never be sent.
func (w *Writer) prepare(m *kafka.Message) (outgoing, error) {
	if err := checkTopic(m.Topic); err != nil {
		return outgoing{}, &relay.PublishError{Code: relay.CodeInvalidTopic, Permanent: true, Err: err}
	}
	table, err := toTable(m.Key, m.Headers)
	if err != nil {
		return outgoing{}, &relay.PublishError{Code: relay.CodeRejected, Permanent: true, Err: fmt.Errorf("rabbitbus: %w", err)}
	}
	if n := len(m.Value) + tableSize(table); n > w.max {
		return outgoing{}, &relay.PublishError{Code: relay.CodeTooLarge, Permanent: true,
			Err: fmt.Errorf("rabbitbus: message is %d bytes (body %d, headers the rest), over MaxMessageBytes (%d)", n, len(m.Value), w.max)}
	}
	ts := m.Time
	if ts.IsZero() {
		ts = time.Now()
	}
	pub := amqp.Publishing{
		Headers:      table,
		DeliveryMode: amqp.Persistent,
		Timestamp:    ts,
		Body:         m.Value,
	}
	if id := messageID(m.Headers); len(id) <= maxShortString && safeShortString(id) {
		pub.MessageId = id
	}
	return outgoing{routingKey: RoutingKey(m.Topic, Partition(m.Key, w.topo.Partitions)), pub: pub}, nil
}

// safeShortString reports whether s can be the message-id property as it
// is (the header carries it anyway).
func safeShortString(s string) bool { return !strings.ContainsRune(s, 0) }

// headerFrameOverhead bounds what a content header frame holds besides the
// headers table: frame framing, class, weight, body size, property flags
// and the other properties this writer sets.
const headerFrameOverhead = 8 + 14 + 1 + (1 + maxShortString) + 8 + 64

// publish sends out and fills in the errors of its messages.
func (w *Writer) publish(ctx context.Context, out []outgoing, errs []error) {
	pc, err := w.channel()
	if err != nil {
		for _, o := range out {
			errs[o.i] = &relay.PublishError{Outage: true, Err: err}
		}
		return
	}
	sent := make([]*inflight, 0, len(out))
	for k, o := range out {
		if pc.frameMax > 0 && tableSize(o.pub.Headers)+headerFrameOverhead > pc.frameMax {
			errs[o.i] = &relay.PublishError{Code: relay.CodeTooLarge, Permanent: true,
				Err: fmt.Errorf("rabbitbus: the headers take %d bytes, more than fit in one frame of this connection (%d)",
					tableSize(o.pub.Headers), pc.frameMax)}
			continue
		}
		f, err := pc.publish(ctx, w.topo.Exchange, o)
		if err != nil {
			// The channel or the connection is gone: what was not sent
			// waits for the broker.
			for _, rest := range out[k:] {
				if errs[rest.i] == nil {
					errs[rest.i] = &relay.PublishError{Outage: true, Err: fmt.Errorf("rabbitbus: publish: %w", err)}
				}
			}
			break
		}
		sent = append(sent, f)
	}
	healthy := pc.wait(ctx, sent)
	for _, f := range sent {
		errs[f.i] = f.result(ctx, pc)
	}
	pc.reset()
	if !healthy {
		w.pc = nil
		pc.close()
	}
}

// channel returns the publishing channel, connecting first when there is
// none or it closed.
func (w *Writer) channel() (*pubChannel, error) {
	if w.pc != nil && !w.pc.isDead() {
		return w.pc, nil
	}
	if w.pc != nil {
		w.pc.close()
		w.pc = nil
	}
	pc, err := openPubChannel(w.dial, w.topo.Exchange)
	if err != nil {
		return nil, err
	}
	w.pc = pc
	return pc, nil
}

// Close closes the writer's connection. Writes after Close fail with
// ErrClosed.
func (w *Writer) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.closed = true
	if w.pc != nil {
		w.pc.close()
		w.pc = nil
	}
	return nil
}

// pubChannel is a connection with one channel in confirm mode, and the
// goroutine that receives its confirms and returns.
type pubChannel struct {
	conn     *amqp.Connection
	ch       *amqp.Channel
	frameMax int

	mu       sync.Mutex
	inflight map[uint64]*inflight // by publish sequence number
	returned []amqp.Return        // returns not yet matched to a confirm
	dead     error                // why the channel ended, once it did
	changed  chan struct{}        // poked when a confirm came or the channel died
}

// inflight is a published message waiting for its confirm.
type inflight struct {
	i          int
	seq        uint64
	routingKey string
	messageID  string
	body       []byte
	size       int

	done     bool // the broker answered
	acked    bool
	returned *amqp.Return
}

func openPubChannel(dial DialFunc, exchange string) (*pubChannel, error) {
	conn, err := dial()
	if err != nil {
		return nil, fmt.Errorf("rabbitbus: connect: %w", err)
	}
	ch, err := conn.Channel()
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("rabbitbus: open channel: %w", err)
	}
	if err := declareExchange(ch, exchange); err != nil {
		_ = conn.Close()
		return nil, err
	}
	if err := ch.Confirm(false); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("rabbitbus: confirm mode: %w", err)
	}
	pc := &pubChannel{conn: conn, ch: ch, frameMax: conn.Config.FrameSize,
		inflight: map[uint64]*inflight{}, changed: make(chan struct{}, 1)}
	// Unbuffered, and read by one goroutine: the broker sends a message's
	// basic.return before its basic.ack, and the client hands both over in
	// that order, so the collector has seen a message's return by the time
	// it sees its confirm.
	returns := ch.NotifyReturn(make(chan amqp.Return))
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation))
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	go pc.collect(returns, confirms, closed)
	return pc, nil
}

// collect records returns and confirms until the channel closes.
func (pc *pubChannel) collect(returns <-chan amqp.Return, confirms <-chan amqp.Confirmation, closed <-chan *amqp.Error) {
	for {
		select {
		case r, ok := <-returns:
			if !ok {
				returns = nil
				continue
			}
			pc.mu.Lock()
			pc.returned = append(pc.returned, r)
			pc.mu.Unlock()
		case c, ok := <-confirms:
			if !ok {
				// The channel closed: its close error, if any, is in closed.
				var why error = amqp.ErrClosed
				select {
				case e := <-closed:
					if e != nil {
						why = e
					}
				default:
				}
				pc.mu.Lock()
				pc.dead = why
				pc.mu.Unlock()
				pc.poke()
				return
			}
			pc.confirm(c)
		}
	}
}

func (pc *pubChannel) poke() {
	select {
	case pc.changed <- struct{}{}:
	default:
	}
}

// confirm records the broker's answer for one message. The broker sends a
// message's basic.return before its basic.ack, and the collector receives
// both in that order, so a returned message's return is in pc.returned by
// the time its confirm comes.
func (pc *pubChannel) confirm(c amqp.Confirmation) {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	f := pc.inflight[c.DeliveryTag]
	if f == nil {
		return
	}
	f.done, f.acked = true, c.Ack
	// The oldest unmatched return with this message's routing key, id and
	// body: a message's return comes before its confirm, and returns of
	// identical messages are interchangeable.
	for i, r := range pc.returned {
		if r.RoutingKey == f.routingKey && r.MessageId == f.messageID && bytes.Equal(r.Body, f.body) {
			f.returned = &r
			pc.returned = append(pc.returned[:i:i], pc.returned[i+1:]...)
			break
		}
	}
	pc.poke()
}

// publish sends one message.
func (pc *pubChannel) publish(ctx context.Context, exchange string, o outgoing) (*inflight, error) {
	f := &inflight{i: o.i, routingKey: o.routingKey, messageID: o.pub.MessageId, body: o.pub.Body,
		size: len(o.pub.Body) + tableSize(o.pub.Headers)}
	// Only this writer publishes on the channel (writes are serialised),
	// so the number stays right; pc.mu is not held while asking for it:
	// the client's reader may be handing the collector a confirm under the
	// lock this takes.
	f.seq = pc.ch.GetNextPublishSeqNo()
	pc.mu.Lock()
	pc.inflight[f.seq] = f
	pc.mu.Unlock()
	// mandatory: a message no queue takes comes back (basic.return) rather
	// than being dropped by the exchange.
	if err := pc.ch.PublishWithContext(ctx, exchange, o.routingKey, true, false, o.pub); err != nil {
		pc.mu.Lock()
		delete(pc.inflight, f.seq)
		pc.mu.Unlock()
		return nil, err
	}
	return f, nil
}

// wait waits until the broker answered for every message of sent, the
// channel died or ctx ended. It reports whether the channel can be used
// again.
func (pc *pubChannel) wait(ctx context.Context, sent []*inflight) bool {
	for {
		pc.mu.Lock()
		open := 0
		for _, f := range sent {
			if !f.done {
				open++
			}
		}
		dead := pc.dead
		pc.mu.Unlock()
		switch {
		case open == 0:
			return dead == nil
		case dead != nil:
			return false
		}
		select {
		case <-pc.changed:
		case <-ctx.Done():
			return false
		}
	}
}

func (pc *pubChannel) isDead() bool {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	return pc.dead != nil || pc.ch.IsClosed() || pc.conn.IsClosed()
}

// reset forgets a finished batch.
func (pc *pubChannel) reset() {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	clear(pc.inflight)
	pc.returned = nil
}

// close closes the connection without waiting for the broker (a channel
// whose answers did not come is not waited for).
func (pc *pubChannel) close() {
	go func() { _ = pc.conn.CloseDeadline(time.Now().Add(5 * time.Second)) }()
}

// result is the outcome of f after wait.
func (f *inflight) result(ctx context.Context, pc *pubChannel) error {
	pc.mu.Lock()
	defer pc.mu.Unlock()
	switch {
	case f.done && f.returned != nil:
		return &relay.PublishError{Err: fmt.Errorf("rabbitbus: unroutable: no queue is bound for routing key %q (%d %s); "+
			"declare the consumers' queues (Setup, or start their readers)", f.routingKey, f.returned.ReplyCode, f.returned.ReplyText)}
	case f.done && f.acked:
		return nil
	case f.done:
		return &relay.PublishError{Err: fmt.Errorf("rabbitbus: the broker refused the message (nack) for routing key %q: "+
			"a full queue (reject-publish) or an internal error", f.routingKey)}
	case pc.dead != nil:
		if limit, ok := sizeLimit(pc.dead); ok {
			if f.size > limit {
				return &relay.PublishError{Code: relay.CodeTooLarge, Permanent: true,
					Err: fmt.Errorf("rabbitbus: the broker refused a message of about %d bytes: %w", f.size, pc.dead)}
			}
		} else if isPrecondition(pc.dead) {
			// The broker closed the channel over a message it refuses;
			// which one is unknown: each spends an attempt, so that the
			// culprit is parked in the end instead of waiting forever.
			return &relay.PublishError{Err: fmt.Errorf("rabbitbus: the broker closed the channel: %w", pc.dead)}
		}
		return &relay.PublishError{Outage: true, Err: fmt.Errorf("rabbitbus: the channel closed before the broker confirmed: %w", pc.dead)}
	default:
		return &relay.PublishError{Outage: true, Err: fmt.Errorf("rabbitbus: no confirm from the broker: %w", context.Cause(ctx))}
	}
}

var sizeLimitRE = regexp.MustCompile(`message size \d+ is larger than configured max size (\d+)`)

// sizeLimit reads the broker's max_message_size from the error it closes a
// channel with when a message is larger.
func sizeLimit(err error) (int, bool) {
	var ae *amqp.Error
	if !errors.As(err, &ae) || ae.Code != amqp.PreconditionFailed {
		return 0, false
	}
	m := sizeLimitRE.FindStringSubmatch(ae.Reason)
	if m == nil {
		return 0, false
	}
	n, err := strconv.Atoi(m[1])
	return n, err == nil
}

func isPrecondition(err error) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Code == amqp.PreconditionFailed
}
