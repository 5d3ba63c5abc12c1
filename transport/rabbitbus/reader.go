package rabbitbus

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/wire"
)

// Reader defaults.
const (
	// PrefetchDefault is how many unacknowledged messages the broker sends
	// ahead to a reader, per partition queue.
	PrefetchDefault = 8
	// StandbyDelayDefault is how long a reader with Members set waits
	// before it subscribes, as a standby, to the partitions that are not
	// its share.
	StandbyDelayDefault = 2 * time.Second
)

// ReaderOpts configures [NewReader]. A nil *ReaderOpts, and every zero
// field, means the default.
type ReaderOpts struct {
	Topology
	// Prefetch is how many unacknowledged messages the broker sends ahead,
	// per partition queue (basic.qos per consumer). Defaults to
	// PrefetchDefault.
	Prefetch int
	// MaxLength is the queues' length bound, as in [SetupOpts]; it must
	// match the queues' declaration. Defaults to none.
	MaxLength int
	// Members and Member spread a group's partitions over its readers.
	// Each partition queue has one active consumer, the one that
	// subscribed first; the others are standbys that take over, in the
	// order they subscribed, when it goes away. With Members = n > 0 the
	// reader numbered Member (0 to n-1) subscribes at once to the
	// partitions p with p % n == Member and StandbyDelay later to the
	// others, so that n readers started together each run a share and stand
	// by for the rest. With Members = 0 (the default) a reader subscribes
	// to every partition at once: the first reader to start runs them all
	// and the others stand by. RabbitMQ does not move a partition back to
	// a reader that returns (there is no rebalance).
	Members, Member int
	// StandbyDelay: see Members. Defaults to StandbyDelayDefault.
	StandbyDelay time.Duration
}

// Reader consumes a group's partition queues of some topics: it satisfies
// the consume seams of package inbox (inbox.Reader), package participant
// and the engine (saga.KafkaReader). FetchMessage and CommitMessages are
// meant for one consume loop; Close may be called from any goroutine.
//
// Each message is acknowledged (basic.ack) when it is committed, on the
// channel it came from. A message fetched and not committed when the
// reader's channel or connection closes is delivered again by the broker,
// to this reader after it reconnects or to another reader of the group.
type Reader struct {
	dial   DialFunc
	group  string
	topics []string
	opts   ReaderOpts

	closing   chan struct{} // closed by Close
	closeOnce sync.Once

	mu      sync.Mutex
	sess    *session
	closed  bool
	offsets map[topicPartition]int64
	pending map[position]unacked
}

type topicPartition struct {
	topic     string
	partition int
}

type position struct {
	topicPartition
	offset int64
}

// unacked is a fetched message not yet committed.
type unacked struct {
	sess *session
	tag  uint64
}

var _ interface {
	FetchMessage(context.Context) (kafka.Message, error)
	CommitMessages(context.Context, ...kafka.Message) error
	Close() error
} = (*Reader)(nil)

// NewReader returns a reader of group's queues for topics. It connects with
// dial when it first fetches (declaring the exchange and the group's queues
// and bindings, as [Setup] does) and again after its connection or channel
// was lost.
func NewReader(dial DialFunc, group string, topics []string, opts *ReaderOpts) (*Reader, error) {
	if dial == nil {
		return nil, fmt.Errorf("%w: dial is nil", ErrInvalidConfig)
	}
	var o ReaderOpts
	if opts != nil {
		o = *opts
	}
	topo, err := o.Topology.withDefaults()
	if err != nil {
		return nil, err
	}
	o.Topology = topo
	if err := checkGroup(group); err != nil {
		return nil, err
	}
	if err := checkTopics(topics); err != nil {
		return nil, err
	}
	if err := checkQueueNames(group, topics, topo.Partitions); err != nil {
		return nil, err
	}
	switch {
	case o.Prefetch < 0 || o.Prefetch > 65535:
		return nil, fmt.Errorf("%w: Prefetch must be between 1 and 65535", ErrInvalidConfig)
	case o.MaxLength < 0:
		return nil, fmt.Errorf("%w: MaxLength must not be negative", ErrInvalidConfig)
	case o.Members < 0 || o.Member < 0 || (o.Members > 0 && o.Member >= o.Members) || (o.Members == 0 && o.Member != 0):
		return nil, fmt.Errorf("%w: Member must be between 0 and Members-1 (Member %d, Members %d)", ErrInvalidConfig, o.Member, o.Members)
	case o.StandbyDelay < 0:
		return nil, fmt.Errorf("%w: StandbyDelay must not be negative", ErrInvalidConfig)
	}
	if o.Prefetch == 0 {
		o.Prefetch = PrefetchDefault
	}
	if o.StandbyDelay == 0 {
		o.StandbyDelay = StandbyDelayDefault
	}
	return &Reader{dial: dial, group: group, topics: slices.Clone(topics), opts: o, closing: make(chan struct{}),
		offsets: map[topicPartition]int64{}, pending: map[position]unacked{}}, nil
}

// FetchMessage returns the next message of any of the reader's partitions,
// in each partition's order. Topic and Partition say where it came from;
// Offset identifies the message for CommitMessages: it grows with each
// message fetched from that partition, and does not repeat across readers
// (it is taken from the clock, in nanoseconds), so that no two deliveries
// share one; it is not a position in the queue (a redelivered message gets
// a new one). Key, Headers and Value are as written (see the package
// documentation), Time is the publisher's timestamp.
//
// A lost connection is reconnected; if that fails, the error is returned
// and the next call tries again.
func (r *Reader) FetchMessage(ctx context.Context) (kafka.Message, error) {
	for {
		s, err := r.session()
		if err != nil {
			return kafka.Message{}, err
		}
		select {
		case d := <-s.deliveries:
			if s.isDead() {
				// Its channel closed: the broker delivers it again.
				continue
			}
			return r.accept(s, d), nil
		case <-s.dead:
			r.drop(s)
		case <-r.closing:
			return kafka.Message{}, ErrClosed
		case <-ctx.Done():
			return kafka.Message{}, ctx.Err()
		}
	}
}

// accept registers d as fetched and converts it.
func (r *Reader) accept(s *session, d delivery) kafka.Message {
	key, headers := fromTable(d.Headers)
	if d.MessageId != "" && messageID(headers) == "" {
		// A producer that is not sagaflow's set only the AMQP message id:
		// it is the message's id all the same.
		headers = append(headers, kafka.Header{Key: wire.HeaderMessageID, Value: []byte(d.MessageId)})
	}
	tp := topicPartition{d.topic, d.partition}
	r.mu.Lock()
	// Not a count from 0: a reader started later (a restart, a standby
	// taking over) must not give an offset that an earlier reader gave,
	// since dead letters are recorded once per position and a message
	// without an id is known by its position. The clock's nanoseconds,
	// made strictly increasing, do not repeat across the readers of a
	// partition, which hold it one after the other.
	off := max(r.offsets[tp]+1, time.Now().UnixNano())
	r.offsets[tp] = off
	r.pending[position{tp, off}] = unacked{sess: s, tag: d.DeliveryTag}
	r.mu.Unlock()
	return kafka.Message{Topic: d.topic, Partition: d.partition, Offset: off, Key: key, Value: d.Body,
		Headers: headers, Time: d.Timestamp}
}

// ErrRedelivered is returned (wrapped) by CommitMessages for a message
// whose channel closed before it was acknowledged: the broker delivers it
// again, and the consumer's deduplication skips what it already processed.
var ErrRedelivered = errors.New("rabbitbus: the message's channel closed before it was acknowledged; the broker delivers it again")

// CommitMessages acknowledges exactly msgs, each on the channel it came
// from. AMQP does not confirm an acknowledgement: one lost with the
// connection makes the broker deliver the message again. A message not
// fetched by this reader, or committed already, is an error; so is one
// whose channel closed ([ErrRedelivered]). The others are acknowledged all
// the same.
func (r *Reader) CommitMessages(_ context.Context, msgs ...kafka.Message) error {
	var errs []error
	for _, m := range msgs {
		p := position{topicPartition{m.Topic, m.Partition}, m.Offset}
		r.mu.Lock()
		u, ok := r.pending[p]
		delete(r.pending, p)
		r.mu.Unlock()
		switch {
		case !ok:
			errs = append(errs, fmt.Errorf("rabbitbus: commit %s/%d@%d: not fetched by this reader, or committed already",
				m.Topic, m.Partition, m.Offset))
		case u.sess.isDead():
			errs = append(errs, fmt.Errorf("rabbitbus: commit %s/%d@%d: %w", m.Topic, m.Partition, m.Offset, ErrRedelivered))
		default:
			if err := u.sess.ch.Ack(u.tag, false); err != nil {
				errs = append(errs, fmt.Errorf("rabbitbus: commit %s/%d@%d: %w (%w)", m.Topic, m.Partition, m.Offset, err, ErrRedelivered))
			}
		}
	}
	return errors.Join(errs...)
}

// Close closes the reader's connection: what it fetched and did not commit
// is delivered again by the broker, to another reader of the group. Fetches
// after Close fail with ErrClosed.
func (r *Reader) Close() error {
	r.closeOnce.Do(func() { close(r.closing) })
	r.mu.Lock()
	r.closed = true
	s := r.sess
	r.sess = nil
	clear(r.pending)
	r.mu.Unlock()
	if s != nil {
		s.close()
	}
	return nil
}

// session returns the current session, connecting first when there is none.
func (r *Reader) session() (*session, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, ErrClosed
	}
	if r.sess != nil {
		return r.sess, nil
	}
	s, err := r.connect()
	if err != nil {
		return nil, err
	}
	r.sess = s
	return s, nil
}

// drop forgets a dead session. What was fetched on it stays pending, so
// that committing it says why it failed ([ErrRedelivered]); the consume
// loop commits every message it fetched, so these are few.
func (r *Reader) drop(s *session) {
	r.mu.Lock()
	if r.sess == s {
		r.sess = nil
	}
	r.mu.Unlock()
	s.close()
}

// session is one connection and channel of a reader, with its consumers.
type session struct {
	conn       *amqp.Connection
	ch         *amqp.Channel
	deliveries chan delivery
	dead       chan struct{} // closed once the channel or connection closed
	deadOnce   sync.Once
	stop       chan struct{} // closed by close: the forwarders end
	stopOnce   sync.Once
}

// delivery is a message and the partition it came from.
type delivery struct {
	amqp.Delivery
	topic     string
	partition int
}

func (s *session) isDead() bool {
	select {
	case <-s.dead:
		return true
	default:
		return false
	}
}

func (s *session) die() { s.deadOnce.Do(func() { close(s.dead) }) }

func (s *session) close() {
	s.stopOnce.Do(func() { close(s.stop) })
	s.die()
	go func() { _ = s.conn.CloseDeadline(time.Now().Add(5 * time.Second)) }()
}

// connect opens a session: declares the exchange and the group's queues,
// and subscribes to them.
func (r *Reader) connect() (*session, error) {
	conn, err := r.dial()
	if err != nil {
		return nil, fmt.Errorf("rabbitbus: connect: %w", err)
	}
	fail := func(err error) (*session, error) {
		_ = conn.Close()
		return nil, err
	}
	ch, err := conn.Channel()
	if err != nil {
		return fail(fmt.Errorf("rabbitbus: open channel: %w", err))
	}
	if err := declareExchange(ch, r.opts.Exchange); err != nil {
		return fail(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := declareGroup(ctx, ch, r.opts.Topology, r.group, r.topics, r.opts.MaxLength); err != nil {
		return fail(err)
	}
	// Per consumer (global false): each partition queue gets its own
	// window, so a busy partition does not starve the others.
	if err := ch.Qos(r.opts.Prefetch, 0, false); err != nil {
		return fail(fmt.Errorf("rabbitbus: qos: %w", err))
	}
	s := &session{conn: conn, ch: ch, deliveries: make(chan delivery), dead: make(chan struct{}), stop: make(chan struct{})}
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))
	chClosed := ch.NotifyClose(make(chan *amqp.Error, 1))
	go func() {
		select {
		case <-connClosed:
		case <-chClosed:
		case <-s.stop:
		}
		s.die()
	}()
	var now, later []topicPartition
	for _, t := range r.topics {
		for p := range r.opts.Partitions {
			tp := topicPartition{t, p}
			if r.opts.Members == 0 || p%r.opts.Members == r.opts.Member {
				now = append(now, tp)
			} else {
				later = append(later, tp)
			}
		}
	}
	for _, tp := range now {
		if err := s.subscribe(r.group, tp); err != nil {
			s.close()
			return nil, err
		}
	}
	if len(later) > 0 {
		go func() {
			t := time.NewTimer(r.opts.StandbyDelay)
			defer t.Stop()
			select {
			case <-t.C:
			case <-s.stop:
				return
			}
			for _, tp := range later {
				if err := s.subscribe(r.group, tp); err != nil {
					// The session is dead or dying; the next one subscribes
					// again.
					s.die()
					return
				}
			}
		}()
	}
	return s, nil
}

// subscribe consumes one partition queue, with manual acknowledgements,
// and forwards its deliveries in order.
func (s *session) subscribe(group string, tp topicPartition) error {
	q := QueueName(group, tp.topic, tp.partition)
	msgs, err := s.ch.Consume(q, "", false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("rabbitbus: consume %q: %w", q, err)
	}
	go func() {
		for d := range msgs {
			select {
			case s.deliveries <- delivery{Delivery: d, topic: tp.topic, partition: tp.partition}:
			case <-s.stop:
				return
			}
		}
		// The channel closed, or the broker cancelled the consumer (its
		// queue was deleted): either way this session no longer reads
		// every partition; the next one subscribes again.
		s.die()
	}()
	return nil
}

// OffsetsNotKept reports true: a message delivered again gets a new Offset
// (see [Reader.FetchMessage]), so an inbox.Consumer dead-letters a message
// that has no id rather than process it twice (see inbox.OffsetsNotKept).
func (r *Reader) OffsetsNotKept() bool { return true }
