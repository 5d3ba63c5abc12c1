package kafkatest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// Option configures a [Cluster].
type Option func(*options)

type options struct {
	kfake []kfake.Opt
}

// NumBrokers sets the number of brokers. Defaults to 1 (kfake's own
// default is 3).
func NumBrokers(n int) Option {
	return func(o *options) { o.kfake = append(o.kfake, kfake.NumBrokers(n)) }
}

// SeedTopics creates topics with the given number of partitions when the
// cluster starts.
func SeedTopics(partitions int32, topics ...string) Option {
	return func(o *options) { o.kfake = append(o.kfake, kfake.SeedTopics(partitions, topics...)) }
}

// AllowAutoTopicCreation lets clients create topics by asking for their
// metadata, as brokers with auto.create.topics.enable do.
func AllowAutoTopicCreation() Option {
	return func(o *options) { o.kfake = append(o.kfake, kfake.AllowAutoTopicCreation()) }
}

// GroupMinSessionTimeout lowers the smallest session timeout the cluster
// grants a consumer group member (6 s by default), so that tests of killed
// consumers need not wait that long.
func GroupMinSessionTimeout(d time.Duration) Option {
	return func(o *options) { o.kfake = append(o.kfake, kfake.GroupMinSessionTimeout(d)) }
}

// DefaultNumPartitions sets the number of partitions of topics created
// without an explicit count (auto-created ones, say).
func DefaultNumPartitions(n int) Option {
	return func(o *options) { o.kfake = append(o.kfake, kfake.DefaultNumPartitions(n)) }
}

// Cluster is an in-process Kafka cluster (kfake) on 127.0.0.1.
type Cluster struct {
	kc    *kfake.Cluster
	addrs []string

	down        atomic.Int64 // active Unreachable faults
	refused     atomic.Int64 // requests refused while unreachable
	produceReqs atomic.Int64 // produce requests received
	closeOnce   sync.Once
}

// Start starts a cluster. The caller must Close it.
func Start(opts ...Option) (*Cluster, error) {
	o := options{kfake: []kfake.Opt{kfake.NumBrokers(1)}}
	for _, opt := range opts {
		opt(&o)
	}
	kc, err := kfake.NewCluster(o.kfake...)
	if err != nil {
		return nil, fmt.Errorf("kafkatest: start cluster: %w", err)
	}
	c := &Cluster{kc: kc, addrs: kc.ListenAddrs()}
	// One control sees every request: it counts produce requests and, while
	// the cluster is unreachable, closes the connection a request came on.
	// It answers nothing otherwise, so the cluster (and its faults) handle
	// the request as usual, and it stays installed.
	kc.Control(func(req kmsg.Request) (kmsg.Response, error, bool) {
		if req.Key() == int16(kmsg.Produce) {
			c.produceReqs.Add(1)
		}
		if c.down.Load() > 0 {
			c.refused.Add(1)
			kc.KeepControl()
			return nil, errUnreachable, true
		}
		return nil, nil, false
	})
	return c, nil
}

var errUnreachable = errors.New("kafkatest: cluster is unreachable")

// New starts a cluster that is closed when the test ends. It fails the test
// if the cluster cannot start.
func New(tb testing.TB, opts ...Option) *Cluster {
	tb.Helper()
	c, err := Start(opts...)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(c.Close)
	return c
}

// Addrs returns the brokers' addresses (host:port), for kafka-go's
// kafka.TCP or a Writer's broker list.
func (c *Cluster) Addrs() []string { return append([]string(nil), c.addrs...) }

// Close stops the cluster and its goroutines. It is safe to call more than
// once.
func (c *Cluster) Close() {
	c.closeOnce.Do(c.kc.Close)
}

// Kfake returns the underlying kfake cluster, for what this package does not
// wrap.
func (c *Cluster) Kfake() *kfake.Cluster { return c.kc }

// CreateTopic creates a topic with the given number of partitions.
func (c *Cluster) CreateTopic(topic string, partitions int32) error {
	if err := c.kc.CreateTopic(topic, partitions, nil); err != nil {
		return fmt.Errorf("kafkatest: create topic %s: %w", topic, err)
	}
	return nil
}

// ProduceRequests returns how many produce requests the cluster received,
// failed ones included.
func (c *Cluster) ProduceRequests() int64 { return c.produceReqs.Load() }

// Fault is an injected failure. Remove ends it.
type Fault struct {
	remove func()
	hits   func() int
	wait   func(ctx context.Context, n int) error
	once   sync.Once
}

// Remove ends the fault. It is safe to call more than once.
func (f *Fault) Remove() { f.once.Do(f.remove) }

// Hits returns how many requests the fault has failed so far.
func (f *Fault) Hits() int { return f.hits() }

// Wait blocks until the fault has failed at least n requests or ctx ends.
func (f *Fault) Wait(ctx context.Context, n int) error { return f.wait(ctx, n) }

// ProduceErr is the error code FailProduce and FailProduceN answer with:
// NOT_ENOUGH_REPLICAS, which clients treat as retriable. The records of a
// failed request are not stored.
var ProduceErr = kerr.NotEnoughReplicas

// FailProduce fails every produce request for topic ("" for every topic):
// each partition of the request is answered with [ProduceErr] and nothing is
// stored, until the returned fault is removed.
func (c *Cluster) FailProduce(topic string) *Fault {
	return c.failProduce(topic, -1)
}

// FailProduceN fails the next n produce requests for topic ("" for every
// topic) as [Cluster.FailProduce] does.
func (c *Cluster) FailProduceN(topic string, n int) *Fault {
	if n <= 0 {
		n = 1
	}
	return c.failProduce(topic, n)
}

func (c *Cluster) failProduce(topic string, count int) *Fault {
	h := c.kc.Fault(kfake.Fault{
		Keys:  []kmsg.Key{kmsg.Produce},
		Topic: topic,
		Err:   ProduceErr,
		Count: count,
	})
	return &Fault{remove: h.Remove, hits: h.Hits, wait: h.Wait}
}

// Unreachable makes every broker close the connection of every request it
// receives, metadata and produce alike, as a cluster that clients cannot
// reach looks to them, until the returned fault is removed. Its Hits count
// the requests refused while any Unreachable fault was active.
func (c *Cluster) Unreachable() *Fault {
	c.down.Add(1)
	f := &Fault{
		remove: func() { c.down.Add(-1) },
		hits:   func() int { return int(c.refused.Load()) },
	}
	f.wait = func(ctx context.Context, n int) error {
		return poll(ctx, func() bool { return f.hits() >= n })
	}
	return f
}

// poll waits until cond holds or ctx ends.
func poll(ctx context.Context, cond func() bool) error {
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}

// ReadAll returns every record stored in topic, partition by partition in
// offset order, read over the wire with kafka-go. Each message has its
// Topic, Partition, Offset, Key, Value, Headers and Time set.
func (c *Cluster) ReadAll(ctx context.Context, topic string) ([]kafka.Message, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
	}
	d := &kafka.Dialer{Timeout: 5 * time.Second}
	parts, err := d.LookupPartitions(ctx, "tcp", c.addrs[0], topic)
	if err != nil {
		return nil, fmt.Errorf("kafkatest: partitions of %s: %w", topic, err)
	}
	var out []kafka.Message
	for _, p := range parts {
		msgs, err := readPartition(ctx, d, c.addrs[0], p)
		if err != nil {
			return nil, fmt.Errorf("kafkatest: read %s/%d: %w", topic, p.ID, err)
		}
		out = append(out, msgs...)
	}
	return out, nil
}

func readPartition(ctx context.Context, d *kafka.Dialer, addr string, p kafka.Partition) ([]kafka.Message, error) {
	conn, err := d.DialPartition(ctx, "tcp", addr, p)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		if err := conn.SetDeadline(dl); err != nil {
			return nil, err
		}
	}
	first, last, err := conn.ReadOffsets()
	if err != nil {
		return nil, err
	}
	if first >= last {
		return nil, nil
	}
	if _, err := conn.Seek(first, kafka.SeekAbsolute); err != nil {
		return nil, err
	}
	var out []kafka.Message
	next := first
	for next < last {
		batch := conn.ReadBatch(1, 64<<20)
		for next < last {
			m, err := batch.ReadMessage()
			if err != nil {
				break
			}
			out = append(out, m)
			next = m.Offset + 1
		}
		if err := batch.Close(); err != nil && next < last {
			return out, err
		}
		if next < last {
			if _, err := conn.Seek(next, kafka.SeekAbsolute); err != nil {
				return out, err
			}
		}
	}
	return out, nil
}
