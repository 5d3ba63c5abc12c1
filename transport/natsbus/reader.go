package natsbus

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/lifecycle"
)

// Reader defaults.
const (
	// PullWaitDefault is how long one pull request waits on the server for
	// a partition's next message (and the longest Close waits for the
	// pulls in flight).
	PullWaitDefault = time.Second
	// AckTimeoutDefault bounds a commit's wait for the server to confirm
	// an acknowledgement, when the caller's context has no deadline.
	AckTimeoutDefault = 10 * time.Second
	// PullWaitMin and PullWaitMax bound ReaderOpts.PullWait: a shorter
	// pull expires before the server can answer it (nothing is ever
	// delivered), and Close waits up to PullWait.
	PullWaitMin = 10 * time.Millisecond
	PullWaitMax = 30 * time.Second
	// AckTimeoutMin is the shortest ReaderOpts.AckTimeout: a commit must
	// have time to reach the server and be confirmed, or the partition,
	// whose message is never acknowledged, delivers nothing behind it.
	AckTimeoutMin = 10 * time.Millisecond
)

// ReaderOpts configures [NewReader]. A nil *ReaderOpts, and every zero
// field, means the default.
type ReaderOpts struct {
	// AckWait is how long the server waits for a reader that holds a
	// message and has gone silent (killed, hung, cut off) before it gives
	// the message to another member of the group. A running reader keeps
	// the messages it holds alive, however long their handling takes.
	// Every member of a group should use the same value; the last reader
	// to start sets it. Defaults to AckWaitDefault.
	AckWait time.Duration
	// PullWait is how long one pull request waits on the server, and the
	// longest [Reader.Close] waits for the pulls in flight to end: from
	// PullWaitMin to PullWaitMax. Defaults to PullWaitDefault.
	PullWait time.Duration
	// AckTimeout bounds a commit when its context has no deadline: at
	// least AckTimeoutMin. Defaults to AckTimeoutDefault.
	AckTimeout time.Duration
}

// Reader consumes topics as a member of a consumer group, through one
// durable pull consumer per partition with at most one message in flight
// (MaxAckPending 1): whichever member pulls a partition's next message
// holds it until it commits it, and nothing behind it on that partition is
// delivered meanwhile, to any member. It implements the reader seams of
// package inbox, package participant and saga.KafkaConfig.NewReader.
//
// FetchMessage returns the next message of whichever partition has one;
// the message's Offset is its stream sequence, its Partition the
// partition, and its HighWaterMark is set so that HighWaterMark-Offset-1
// is the number of messages still waiting on its partition.
// CommitMessages acknowledges exactly the messages given and waits for the
// server to confirm (double ack). A message fetched and not committed is
// kept alive while the reader runs; [Reader.Close] hands it back at once,
// and a reader that dies or loses its connection gives it up after
// AckWait.
//
// The reader creates its group's consumers as it starts, and retries in
// the background while the server or a topic's stream is missing: those
// failures are what FetchMessage returns, so a consume loop logs them and
// tries again.
type Reader struct {
	js     jetstream.JetStream
	group  string
	topics []string
	o      ReaderOpts

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	ready  chan *delivery // unbuffered: a receive is the moment a message is handed out
	errs   chan error

	mu   sync.Mutex
	held map[position]*delivery // handed out, not committed
	shut bool
}

type position struct {
	topic     string
	partition int
	offset    int64
}

// delivery is a message a partition's goroutine pulled; done closes when it
// is committed or the reader closes.
type delivery struct {
	msg  jetstream.Msg
	km   kafka.Message
	done chan struct{}
	once sync.Once
}

func (d *delivery) finish() { d.once.Do(func() { close(d.done) }) }

// NewReader returns a member of group that consumes topics from js, and
// starts it: it finds each topic's stream (made by [Setup]), creates the
// group's consumer of each partition if missing, and pulls. It fails only
// on arguments; see [Reader] for what happens when the server is away.
func NewReader(js jetstream.JetStream, group string, topics []string, opts *ReaderOpts) (*Reader, error) {
	var o ReaderOpts
	if opts != nil {
		o = *opts
	}
	if js == nil {
		return nil, fmt.Errorf("%w: js is nil", ErrInvalidConfig)
	}
	if group == "" {
		return nil, fmt.Errorf("%w: group is empty", ErrInvalidConfig)
	}
	if err := checkTopics(topics); err != nil {
		return nil, err
	}
	if o.AckWait < 0 || o.PullWait < 0 || o.AckTimeout < 0 {
		return nil, fmt.Errorf("%w: AckWait, PullWait and AckTimeout must not be negative", ErrInvalidConfig)
	}
	setDefault(&o.AckWait, AckWaitDefault)
	setDefault(&o.PullWait, PullWaitDefault)
	setDefault(&o.AckTimeout, AckTimeoutDefault)
	if o.AckWait < 3*time.Millisecond {
		return nil, fmt.Errorf("%w: AckWait %v is too short", ErrInvalidConfig, o.AckWait)
	}
	if o.PullWait < PullWaitMin || o.PullWait > PullWaitMax {
		return nil, fmt.Errorf("%w: PullWait %v is outside PullWaitMin (%v) to PullWaitMax (%v)", ErrInvalidConfig, o.PullWait, PullWaitMin, PullWaitMax)
	}
	if o.AckTimeout < AckTimeoutMin {
		return nil, fmt.Errorf("%w: AckTimeout %v is shorter than AckTimeoutMin (%v)", ErrInvalidConfig, o.AckTimeout, AckTimeoutMin)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &Reader{js: js, group: group, topics: append([]string(nil), topics...), o: o, ctx: ctx, cancel: cancel,
		ready: make(chan *delivery), errs: make(chan error, 1), held: map[position]*delivery{}}
	for _, t := range r.topics {
		r.wg.Go(func() { r.runTopic(t) })
	}
	return r, nil
}

// report hands err to the next FetchMessage, unless one is waiting already.
func (r *Reader) report(err error) {
	if r.ctx.Err() != nil {
		return
	}
	select {
	case r.errs <- err:
	default:
	}
}

// runTopic learns topic's partitions and runs one goroutine per partition.
func (r *Reader) runTopic(topic string) {
	for failures := 1; r.ctx.Err() == nil; failures++ {
		s, err := r.js.Stream(r.ctx, StreamName(topic))
		var n int
		if err == nil {
			n, err = partitionsOf(topic, s.CachedInfo().Config.Subjects)
		}
		if err != nil {
			r.report(fmt.Errorf("natsbus: group %s: stream %s of topic %s: %w", r.group, StreamName(topic), topic, err))
			if !lifecycle.Sleep(r.ctx, lifecycle.Backoff(failures)) {
				return
			}
			continue
		}
		for p := range n {
			r.wg.Go(func() { r.runPartition(topic, p) })
		}
		return
	}
}

// runPartition pulls one partition's messages, one at a time: it pulls the
// next only when the one it handed out was committed.
func (r *Reader) runPartition(topic string, p int) {
	var cons jetstream.Consumer
	failures := 0
	fail := func(err error) bool {
		failures++
		r.report(err)
		return lifecycle.Sleep(r.ctx, lifecycle.Backoff(failures))
	}
	for r.ctx.Err() == nil {
		if cons == nil {
			c, err := ensureConsumer(r.ctx, r.js, topic, r.group, p, r.o.AckWait)
			if err != nil {
				if !fail(err) {
					return
				}
				continue
			}
			cons = c
		}
		m, err := r.pull(cons)
		if err != nil {
			if errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrConsumerDeleted) {
				cons = nil // deleted under us: create it again
			}
			if !fail(fmt.Errorf("natsbus: group %s: pull %s: %w", r.group, Subject(topic, p), err)) {
				return
			}
			continue
		}
		failures = 0
		if m == nil {
			continue // the pull expired empty
		}
		if r.ctx.Err() != nil {
			_ = m.Nak() // came after Close: another member takes it now
			return
		}
		d := &delivery{msg: m, km: toKafka(topic, p, m), done: make(chan struct{})}
		if !r.hand(d) {
			return
		}
	}
}

// pull waits up to PullWait for the partition's next message; nil when
// none came.
func (r *Reader) pull(cons jetstream.Consumer) (jetstream.Msg, error) {
	// Not r.ctx: a pull cut short by Close would leave the server's
	// request open until its expiry, and a message delivered to it
	// meanwhile would reach an inbox nobody reads and be held until
	// AckWait, its partition with it. The pull runs to its end (the
	// server's expiry comes first: FetchContext gives it 90% of the
	// time), and what it brings after Close is given back.
	ctx, cancel := context.WithTimeout(context.Background(), r.o.PullWait)
	defer cancel()
	batch, err := cons.Fetch(1, jetstream.FetchContext(ctx))
	if err != nil {
		if r.ctx.Err() != nil {
			return nil, nil
		}
		return nil, err
	}
	var m jetstream.Msg
	for msg := range batch.Messages() {
		m = msg
	}
	if m != nil {
		return m, nil
	}
	if err := batch.Error(); err != nil && !errors.Is(err, context.DeadlineExceeded) && r.ctx.Err() == nil {
		return nil, err
	}
	return nil, nil
}

// hand offers d to FetchMessage and then waits for its commit, keeping it
// alive on the server meanwhile. It reports false when the reader closed.
func (r *Reader) hand(d *delivery) bool {
	tick := time.NewTicker(r.o.AckWait / 3)
	defer tick.Stop()
	for handed := false; !handed; {
		select {
		case r.ready <- d:
			handed = true
		case <-tick.C:
			_ = d.msg.InProgress()
		case <-r.ctx.Done():
			_ = d.msg.Nak() // not handed out: give it to another member now
			return false
		}
	}
	for {
		select {
		case <-d.done:
			return r.ctx.Err() == nil
		case <-tick.C:
			_ = d.msg.InProgress()
		case <-r.ctx.Done():
			return false // Close gives it back
		}
	}
}

// FetchMessage returns the next message of any of the reader's partitions,
// waiting for one until ctx ends. It returns the failures of the
// background pulls (the server or a stream missing) as they happen, and
// ErrClosed once the reader is closed.
func (r *Reader) FetchMessage(ctx context.Context) (kafka.Message, error) {
	select {
	case d := <-r.ready:
		r.mu.Lock()
		if r.shut {
			r.mu.Unlock()
			_ = d.msg.Nak()
			return kafka.Message{}, ErrClosed
		}
		r.held[keyOf(d.km)] = d
		r.mu.Unlock()
		return d.km, nil
	case err := <-r.errs:
		return kafka.Message{}, err
	case <-r.ctx.Done():
		return kafka.Message{}, ErrClosed
	case <-ctx.Done():
		return kafka.Message{}, ctx.Err()
	}
}

func keyOf(m kafka.Message) position { return position{m.Topic, m.Partition, m.Offset} }

// CommitMessages acknowledges msgs, each of which this reader must have
// returned and not committed yet, and waits for the server to confirm
// each acknowledgement. The acknowledgements go out at once, not one after
// the other: they are of different partitions (a partition has one message
// out at a time), and each partition's next message waits for its own. A
// message whose acknowledgement failed comes again (to this member or
// another) after AckWait, unless the acknowledgement reached the server
// before the confirmation was lost (a connection that closed meanwhile): an
// error says that a message may come again, not that it will. The inbox
// dedupes it either way.
func (r *Reader) CommitMessages(ctx context.Context, msgs ...kafka.Message) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, r.o.AckTimeout)
		defer cancel()
	}
	errs := make([]error, len(msgs))
	var wg sync.WaitGroup
	for i, m := range msgs {
		k := keyOf(m)
		r.mu.Lock()
		d := r.held[k]
		delete(r.held, k)
		r.mu.Unlock()
		if d == nil {
			errs[i] = fmt.Errorf("natsbus: commit %s/%d/%d: not a message this reader holds", m.Topic, m.Partition, m.Offset)
			continue
		}
		wg.Go(func() {
			err := d.msg.DoubleAck(ctx)
			d.finish()
			if err != nil {
				errs[i] = fmt.Errorf("natsbus: commit %s/%d/%d: %w", m.Topic, m.Partition, m.Offset, err)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Close stops the reader and gives back at once (a negative
// acknowledgement) every message it held and had not committed, so another
// member of the group takes it without waiting for AckWait. It waits for
// the partitions' pulls in flight to end (at most PullWait), giving back
// what they bring: a message the server sent to a pull that was no longer
// read would be held until AckWait. It does not close the connection.
// Calling it again does nothing.
func (r *Reader) Close() error {
	r.mu.Lock()
	if r.shut {
		r.mu.Unlock()
		return nil
	}
	r.shut = true
	r.mu.Unlock()
	r.cancel()
	r.wg.Wait()
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, d := range r.held {
		_ = d.msg.Nak()
		d.finish()
		delete(r.held, k)
	}
	return nil
}

// toKafka converts a message of topic's partition p.
func toKafka(topic string, p int, m jetstream.Msg) kafka.Message {
	km := kafka.Message{Topic: topic, Partition: p, Offset: -1, Value: m.Data()}
	if meta, err := m.Metadata(); err == nil {
		km.Offset = int64(meta.Sequence.Stream)
		km.HighWaterMark = km.Offset + 1 + int64(meta.NumPending)
		km.Time = meta.Timestamp
	}
	hs := m.Headers()
	names := make([]string, 0, len(hs))
	for name := range hs {
		names = append(names, name)
	}
	sort.Strings(names) // NATS keeps no order between names
	for _, name := range names {
		values := hs[name]
		if len(values) == 0 {
			continue
		}
		switch name {
		case msgIDHeader:
			continue // set by the writer from sagaflow-message-id
		case KeyHeader:
			// The key; a repeated key header stays among the headers, so
			// that the consumer sees the message is ambiguous.
			km.Key, values = []byte(values[0]), values[1:]
		}
		for _, v := range values {
			km.Headers = append(km.Headers, kafka.Header{Key: name, Value: []byte(v)})
		}
	}
	return km
}
