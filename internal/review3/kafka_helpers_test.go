package review3_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/wire"
)

// hdr is one Kafka header; a message is built from a list of them, so that a
// test can leave one out, repeat it, or put any bytes in it.
type hdr struct{ k, v string }

// signHand computes sagaflow-signature as docs/protocol.md "Signing" says,
// from the headers present in hs (the first copy of each) and the value.
func signHand(key []byte, hs []hdr, value []byte) string {
	get := func(name string) string {
		for _, h := range hs {
			if h.k == name {
				return h.v
			}
		}
		return ""
	}
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte("sagaflow-signature-v1"))
	for _, name := range []string{wire.HeaderType, wire.HeaderSagaID, wire.HeaderStepKey, wire.HeaderDirection, wire.HeaderReplyTo} {
		v := get(name)
		mac.Write([]byte(strconv.Itoa(len(v)) + ":" + v))
	}
	mac.Write([]byte(strconv.Itoa(len(value)) + ":"))
	mac.Write(value)
	return "v1=" + hex.EncodeToString(mac.Sum(nil))
}

// producer is a raw franz-go client, as a service in another language would
// have: it sends exactly the bytes it is given.
func producer(t *testing.T, kc *kafkatest.Cluster) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(kc.Addrs()...))
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	return cl
}

func send(t *testing.T, cl *kgo.Client, topic, key string, hs []hdr, value []byte) {
	t.Helper()
	rec := &kgo.Record{Topic: topic, Key: []byte(key), Value: value}
	for _, h := range hs {
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: h.k, Value: []byte(h.v)})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, cl.ProduceSync(ctx, rec).FirstErr())
}

// collector reads every record of topics from the start, in the background.
type collector struct {
	mu   sync.Mutex
	recs []*kgo.Record
}

func collect(t *testing.T, kc *kafkatest.Cluster, topics ...string) *collector {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(kc.Addrs()...), kgo.ConsumeTopics(topics...),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(50*time.Millisecond))
	require.NoError(t, err)
	c := &collector{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			fs := cl.PollFetches(ctx)
			fs.EachRecord(func(r *kgo.Record) {
				c.mu.Lock()
				c.recs = append(c.recs, r)
				c.mu.Unlock()
			})
		}
	}()
	t.Cleanup(func() { cancel(); <-done; cl.Close() })
	return c
}

// with returns the records whose header name has value v.
func (c *collector) with(name, v string) []*kgo.Record {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*kgo.Record
	for _, r := range c.recs {
		if got, _ := header(r, name); got == v {
			out = append(out, r)
		}
	}
	return out
}

func header(r *kgo.Record, name string) (string, int) {
	v, n := "", 0
	for _, h := range r.Headers {
		if h.Key == name {
			if n == 0 {
				v = string(h.Value)
			}
			n++
		}
	}
	return v, n
}

// eventually polls cond every 20ms until it holds or d passes.
func eventually(t *testing.T, d time.Duration, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func newID() string { return uuid.Must(uuid.NewV7()).String() }
