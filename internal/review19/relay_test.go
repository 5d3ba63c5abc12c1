package review19_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/wire"
)

// slowFlaky is a relay.Writer (the seam the relay docs describe) that takes
// delay for every write, as a slow broker would, and fails the first
// attempt of every message whose key is in fail with an error that is
// neither permanent nor an outage: "the row spends an attempt and is
// retried after Backoff".
type slowFlaky struct {
	inner relay.Writer
	delay time.Duration

	mu     sync.Mutex
	fail   map[string]bool
	failed map[string]int
	writes int
}

func (w *slowFlaky) failFirst(key string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.fail[key] = true
}

func (w *slowFlaky) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	select {
	case <-time.After(w.delay):
	case <-ctx.Done():
		return ctx.Err()
	}
	errs := make(kafka.WriteErrors, len(msgs))
	var pass []kafka.Message
	var at []int
	w.mu.Lock()
	w.writes++
	for i, m := range msgs {
		k := string(m.Key)
		if w.fail[k] && w.failed[k] == 0 {
			w.failed[k]++
			errs[i] = &relay.PublishError{Err: errors.New("review19: the broker said try again")}
			continue
		}
		pass = append(pass, m)
		at = append(at, i)
	}
	w.mu.Unlock()
	if len(pass) > 0 {
		if err := w.inner.WriteMessages(ctx, pass...); err != nil {
			var we kafka.WriteErrors
			if !errors.As(err, &we) {
				return err
			}
			for j, e := range we {
				errs[at[j]] = e
			}
		}
	}
	for _, e := range errs {
		if e != nil {
			return errs
		}
	}
	return nil
}

func (w *slowFlaky) Close() error { return nil }

// relayTenant is a schema with a relay polling once a minute through a
// slowFlaky writer, publishing to topic.
type relayTenant struct {
	d     *testkit.DB
	ob    *outbox.Outbox
	w     *slowFlaky
	r     *relay.Relay
	topic string
}

func newRelayTenant(t *testing.T, kc *kafkatest.Cluster, topic string, delay time.Duration) *relayTenant {
	t.Helper()
	rt := &relayTenant{d: testkit.NewDB(t), topic: topic}
	var err error
	rt.ob, err = outbox.New(rt.d.Pool, rt.d.Schema)
	require.NoError(t, err)
	kw := relay.NewKafkaWriter(kc.Addrs(), nil)
	rt.w = &slowFlaky{inner: kw, delay: delay, fail: map[string]bool{}, failed: map[string]int{}}
	rt.r, err = relay.New(rt.d.Pool, rt.w, &relay.Config{Schema: rt.d.Schema, PollInterval: poll, BatchSize: 4, MaxAttempts: 5,
		Backoff: func(int) time.Duration { return 100 * time.Millisecond }, Logger: testkit.Discard})
	require.NoError(t, err)
	require.NoError(t, rt.r.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, rt.r.Stop(ctx))
		require.NoError(t, kw.Close())
	})
	return rt
}

// insert writes msgs in one transaction (InsertTx notifies the relay at
// its commit).
func (rt *relayTenant) insert(t *testing.T, msgs ...outbox.Message) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, pgx.BeginFunc(ctx, rt.d.Pool, func(tx pgx.Tx) error {
		for _, m := range msgs {
			if err := rt.ob.InsertTx(ctx, tx, m); err != nil {
				return err
			}
		}
		return nil
	}))
}

func (rt *relayTenant) msg(key string, delay time.Duration) outbox.Message {
	return outbox.Message{Topic: rt.topic, Key: key, Type: "r19.event", Payload: []byte(`{"k":"` + key + `"}`), Delay: delay}
}

// published maps each key on the topic to the distinct message ids seen.
func published(t *testing.T, kc *kafkatest.Cluster, topic string) map[string]map[string]bool {
	t.Helper()
	msgs, err := kc.ReadAll(context.Background(), topic)
	require.NoError(t, err)
	out := map[string]map[string]bool{}
	for _, m := range msgs {
		k := string(m.Key)
		if out[k] == nil {
			out[k] = map[string]bool{}
		}
		for _, h := range m.Headers {
			if h.Key == wire.HeaderMessageID {
				out[k][string(h.Value)] = true
			}
		}
	}
	return out
}

// A relay polling once a minute, whose writes take 250 ms, in two tenants
// on one cluster. First, rows whose first publish fails, one at a time: the
// relay marks each for a retry 100 ms later, which comes due during (or
// right after) its own cycle, before its look ahead ("The relays look ahead
// the same way after each drain"; relay doc: an idle relay waits for "the
// next row coming due (a retry, or a row written with a delay)"). Then a
// drain of 24 rows in batches of 4, a third of which fail once, and 6 rows
// written with delays of 100 ms to 1.1 s during it. Every row is published
// within 15 s, each with one message id, every failure retried once, none
// dead.
func TestRelayRetriesComingDueAroundSlowCycles(t *testing.T) {
	t.Parallel()
	kc := kafkatest.New(t, kafkatest.SeedTopics(2, "r19.t0.events", "r19.t1.events"))
	var ts [2]*relayTenant
	for k := range ts {
		ts[k] = newRelayTenant(t, kc, fmt.Sprintf("r19.t%d.events", k), 250*time.Millisecond)
	}
	for k, rt := range ts {
		t.Run(fmt.Sprint("tenant", k), func(t *testing.T) {
			t.Parallel()
			relayTenantRun(t, kc, k, rt)
		})
	}
}

func relayTenantRun(t *testing.T, kc *kafkatest.Cluster, k int, rt *relayTenant) {
	// One at a time: the lone retry.
	var lags []time.Duration
	for i := range 4 {
		key := fmt.Sprintf("t%d-lone%d", k, i)
		rt.w.failFirst(key)
		began := time.Now()
		rt.insert(t, rt.msg(key, 0))
		testkit.WaitFor(t, within, "the lone row "+key+" published after its retry", func() bool {
			return len(published(t, kc, rt.topic)[key]) == 1
		})
		lags = append(lags, time.Since(began).Round(time.Millisecond))
	}
	t.Logf("tenant %d: lone rows failing once published after %v", k, lags)

	// A drain with retries and delayed rows.
	var batch []outbox.Message
	for i := range 24 {
		key := fmt.Sprintf("t%d-d%d", k, i)
		if i%3 == 1 {
			rt.w.failFirst(key)
		}
		batch = append(batch, rt.msg(key, 0))
	}
	began := time.Now()
	rt.insert(t, batch...)
	for i := range 6 {
		time.Sleep(120 * time.Millisecond)
		rt.insert(t, rt.msg(fmt.Sprintf("t%d-late%d", k, i), time.Duration(100+200*i)*time.Millisecond))
	}
	testkit.WaitFor(t, within, "every row of the drain published", func() bool {
		p := published(t, kc, rt.topic)
		for i := range 24 {
			if len(p[fmt.Sprintf("t%d-d%d", k, i)]) == 0 {
				return false
			}
		}
		for i := range 6 {
			if len(p[fmt.Sprintf("t%d-late%d", k, i)]) == 0 {
				return false
			}
		}
		return true
	})
	t.Logf("tenant %d: the drain's 30 rows published within %s", k, time.Since(began).Round(time.Millisecond))

	p := published(t, kc, rt.topic)
	require.Len(t, p, 34, "tenant %d: keys on its topic (the other tenant's rows are not there)", k)
	for key, ids := range p {
		require.Len(t, ids, 1, "tenant %d: %s published under one message id", k, key)
	}
	testkit.WaitFor(t, 5*time.Second, "nothing pending", func() bool {
		h, err := rt.r.Health(context.Background())
		require.NoError(t, err)
		return h.Pending == 0
	})
	h, err := rt.r.Health(context.Background())
	require.NoError(t, err)
	rt.w.mu.Lock()
	writes := rt.w.writes
	rt.w.mu.Unlock()
	t.Logf("tenant %d: health %+v; writes %d", k, h, writes)
	require.EqualValues(t, 12, h.Retries, "tenant %d: the rows that failed once were put back once each", k)
	require.Zero(t, h.Dead, "tenant %d", k)
}
