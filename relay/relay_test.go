package relay_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/lifecycle"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/relay"
)

func seqOf(t *testing.T, m kafka.Message) int {
	t.Helper()
	var p struct{ Seq int }
	require.NoError(t, json.Unmarshal(m.Value, &p), "payload %q", m.Value)
	return p.Seq
}

func TestPublishesRowsWithKeysHeadersAndPerKeyOrder(t *testing.T) {
	t.Parallel()
	e := setup(t)
	r := e.relay(t, e.writer(t), relay.Config{BatchSize: 7})

	const n = 40
	sagaID := uuid.Must(uuid.NewV7())
	ids := map[uuid.UUID]int{}
	for i := range n {
		topic := topicOrders
		if i%2 == 1 {
			topic = topicPayments
		}
		key := fmt.Sprintf("order-%d", i%5)
		id := e.insert(t, topic, key, i, func(m *store.Message) {
			m.Headers = map[string]string{
				"traceparent": fmt.Sprintf("00-%032x-%016x-01", i+1, i+1),
				"tracestate":  "vendor=x",
				"custom":      "value",
			}
			if i%3 == 0 {
				m.SagaID = &sagaID
				stepKey := fmt.Sprintf("%s/reserve/forward/%d", sagaID, i)
				m.StepKey = &stepKey
			}
		})
		ids[id] = i
	}

	published, failed := drain(t, e.ctx, r)
	require.Equal(t, n, published)
	require.Zero(t, failed)

	msgs := e.read(t, topicOrders, topicPayments)
	require.Len(t, msgs, n)
	lastSeq := map[string]int{}     // key -> last seq seen, in partition order
	partitionOf := map[string]int{} // key -> partition
	for _, m := range msgs {
		seq := seqOf(t, m)
		idStr, _ := header(m, store.HeaderMessageID)
		id := uuid.MustParse(idStr)
		require.Equal(t, seq, ids[id], "message id header names the row")
		require.Equal(t, fmt.Sprintf("order-%d", seq%5), string(m.Key), "key is the aggregateid")
		wantTopic := topicOrders
		if seq%2 == 1 {
			wantTopic = topicPayments
		}
		require.Equal(t, wantTopic, m.Topic)
		typ, _ := header(m, store.HeaderType)
		require.Equal(t, "test.event", typ)
		tp, _ := header(m, "traceparent")
		require.Equal(t, fmt.Sprintf("00-%032x-%016x-01", seq+1, seq+1), tp)
		ts, _ := header(m, "tracestate")
		require.Equal(t, "vendor=x", ts)
		custom, _ := header(m, "custom")
		require.Equal(t, "value", custom)
		sid, hasSaga := header(m, store.HeaderSagaID)
		sk, hasStep := header(m, store.HeaderStepKey)
		if seq%3 == 0 {
			require.True(t, hasSaga && hasStep)
			require.Equal(t, sagaID.String(), sid)
			require.Equal(t, fmt.Sprintf("%s/reserve/forward/%d", sagaID, seq), sk)
		} else {
			require.False(t, hasSaga || hasStep, "no saga headers for a row without a saga")
		}

		// Per key: one partition, and the order the rows were written.
		k := m.Topic + "/" + string(m.Key)
		if p, ok := partitionOf[k]; ok {
			require.Equal(t, p, m.Partition, "key %s in two partitions", k)
			require.Greater(t, seq, lastSeq[k], "key %s out of order", k)
		}
		partitionOf[k] = m.Partition
		lastSeq[k] = seq
	}

	for id := range ids {
		got := e.row(t, id)
		require.Equal(t, store.OutboxPublished, got.Status)
		require.True(t, got.Published)
		require.Equal(t, 1, got.Attempts)
		require.Empty(t, got.LastError)
	}
	h, err := r.Health(e.ctx)
	require.NoError(t, err)
	require.Equal(t, int64(n), h.Published)
	require.Zero(t, h.Pending)
	require.Zero(t, h.Dead)
	require.Zero(t, h.Retries)
	require.Equal(t, int64(6), h.Writes, "one write per batch of 7")
	require.Positive(t, h.LastPublishLatency)
	require.Positive(t, h.AvgPublishLatency)
	require.False(t, h.Running)
}

func TestCrashAfterBrokerAckPublishesTheBatchAgain(t *testing.T) {
	t.Parallel()
	e := setup(t)
	r := e.relay(t, e.writer(t), relay.Config{})
	var ids []uuid.UUID
	for i := range 5 {
		ids = append(ids, e.insert(t, topicOrders, fmt.Sprintf("k%d", i), i))
	}

	crashes := 0
	relay.SetAfterPublish(r, func() error {
		if crashes == 0 {
			crashes++
			return errors.New("crash: killed after the broker acknowledged")
		}
		return nil
	})
	_, _, err := r.RunOnce(e.ctx)
	require.ErrorContains(t, err, "crash")
	require.Len(t, e.read(t, topicOrders), 5, "the broker has the batch")
	for _, id := range ids {
		got := e.row(t, id)
		require.Equal(t, store.OutboxPending, got.Status, "the crash lost the marks")
		require.Zero(t, got.Attempts)
	}

	published, failed := drain(t, e.ctx, r)
	require.Equal(t, 5, published)
	require.Zero(t, failed)

	// At least once: every message twice, and both copies carry the row's
	// id, which is what consumers deduplicate on.
	msgs := e.read(t, topicOrders)
	require.Len(t, msgs, 10)
	got := copies(t, msgs)
	require.Len(t, got, 5)
	for _, id := range ids {
		require.Equal(t, 2, got[id.String()], "copies of %s", id)
		require.Equal(t, store.OutboxPublished, e.row(t, id).Status)
	}
	byID := map[string][]kafka.Message{}
	for _, m := range msgs {
		id, _ := header(m, store.HeaderMessageID)
		byID[id] = append(byID[id], m)
	}
	for id, ms := range byID {
		require.Equal(t, ms[0].Value, ms[1].Value, "copies of %s differ", id)
		require.Equal(t, ms[0].Key, ms[1].Key)
		require.Equal(t, ms[0].Partition, ms[1].Partition)
	}

	// And a consumer that deduplicates through the inbox runs its handler
	// once per row.
	in, err := inbox.New(e.pool, &inbox.Config{Consumer: "relay-test", Schema: e.schema, Logger: quiet})
	require.NoError(t, err)
	handled := map[string]int{}
	for _, m := range msgs {
		_, err := in.Process(e.ctx, inbox.FromKafka(m), func(_ context.Context, _ pgx.Tx, msg inbox.Message) error {
			handled[msg.ID]++
			return nil
		})
		require.NoError(t, err)
	}
	require.Len(t, handled, 5)
	for _, id := range ids {
		require.Equal(t, 1, handled[id.String()])
	}
}

func TestBrokerUnreachableThenBack(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w := e.writer(t)
	const backoff = 300 * time.Millisecond
	r := e.relay(t, w, relay.Config{
		Backoff:      func(int) time.Duration { return backoff },
		PollInterval: time.Minute, // only the retries coming due wake the loop
	})
	// Connect the writer first, as a long-running relay would have.
	e.insert(t, topicOrders, "warm-up", -1)
	p, _, err := r.RunOnce(e.ctx)
	require.NoError(t, err)
	require.Equal(t, 1, p)

	var ids []uuid.UUID
	for i := range 6 {
		topic := topicOrders
		if i%2 == 1 {
			topic = topicPayments
		}
		ids = append(ids, e.insert(t, topic, fmt.Sprintf("k%d", i), i))
	}
	down := e.kc.Unreachable()
	defer down.Remove()

	published, failed, err := r.RunOnce(e.ctx)
	require.NoError(t, err, "a broker failure is an outcome, not an error")
	require.Zero(t, published)
	require.Equal(t, 6, failed)
	require.Positive(t, down.Hits())
	for _, id := range ids {
		got := e.row(t, id)
		require.Equal(t, store.OutboxPending, got.Status)
		require.Zero(t, got.Attempts, "an unreachable broker spends no attempt")
		require.Contains(t, got.LastError, "relay: publish")
		require.Greater(t, got.DueIn, time.Duration(0), "available_at pushed back")
		require.LessOrEqual(t, got.DueIn, backoff)
	}
	published, failed, err = r.RunOnce(e.ctx)
	require.NoError(t, err)
	require.Zero(t, published+failed, "nothing is due during the backoff")

	// The running relay retries when the backoff ends, while the cluster
	// is still down, and publishes once it is back.
	require.NoError(t, r.Start(e.ctx))
	waitFor(t, 10*time.Second, "a second failed attempt of every row", func() bool {
		h, err := r.Health(e.ctx)
		require.NoError(t, err)
		return h.OutageWaits >= 12
	})
	h, err := r.Health(e.ctx)
	require.NoError(t, err)
	require.Positive(t, h.ConsecutiveOutages)
	for _, id := range ids {
		require.Zero(t, e.row(t, id).Attempts)
	}
	down.Remove()
	waitFor(t, 20*time.Second, "every row published", func() bool {
		return e.count(t, store.OutboxPending) == 0
	})
	msgs := e.read(t, topicOrders, topicPayments)
	got := copies(t, msgs)
	require.Len(t, msgs, 7, "each message stored once: failed produce requests store nothing")
	for _, id := range ids {
		require.Equal(t, 1, got[id.String()])
		row := e.row(t, id)
		require.Equal(t, store.OutboxPublished, row.Status)
		require.Equal(t, 1, row.Attempts, "only the attempt that published counts")
		require.Empty(t, row.LastError)
	}
	h, err = r.Health(e.ctx)
	require.NoError(t, err)
	require.True(t, h.Running)
	require.GreaterOrEqual(t, h.OutageWaits, int64(12))
	require.Zero(t, h.Retries)
	require.Zero(t, h.ConsecutiveOutages, "reset by the write that got through")
	require.Equal(t, int64(7), h.Published)
}

func TestRowFailingMaxAttemptsBecomesDead(t *testing.T) {
	t.Parallel()
	e := setup(t)
	r := e.relay(t, e.writer(t), relay.Config{MaxAttempts: 3, Backoff: func(int) time.Duration { return 0 }})
	// A refusal about the topic rather than the cluster (an ACL that
	// denies the relay) spends attempts; an outage would not.
	broken := e.kc.Kfake().Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topicBroken,
		Err: kerr.TopicAuthorizationFailed, Count: -1})
	defer broken.Remove()

	bad := e.insert(t, topicBroken, "k", 0)
	var good []uuid.UUID
	for i := range 3 {
		// Rows for a healthy topic keep flowing while the broken one retries.
		good = append(good, e.insert(t, topicOrders, "k", i+1))
		p, f, err := r.RunOnce(e.ctx)
		require.NoError(t, err)
		require.Equal(t, 1, p)
		require.Equal(t, 1, f)
		got := e.row(t, bad)
		require.Equal(t, i+1, got.Attempts)
		require.Contains(t, got.LastError, "Topic Authorization Failed")
		if i < 2 {
			require.Equal(t, store.OutboxPending, got.Status)
		}
	}
	got := e.row(t, bad)
	require.Equal(t, store.OutboxDead, got.Status)
	require.True(t, strings.HasPrefix(got.LastError, relay.CodeAttemptsExhausted+": gave up after 3 attempts: "), got.LastError)
	require.Contains(t, got.LastError, "broken")
	for _, id := range good {
		require.Equal(t, store.OutboxPublished, e.row(t, id).Status)
	}
	p, f, err := r.RunOnce(e.ctx)
	require.NoError(t, err)
	require.Zero(t, p+f, "a dead row is not claimed again")
	require.Empty(t, e.read(t, topicBroken))

	h, err := r.Health(e.ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), h.Dead)
	require.Equal(t, int64(1), h.DeadLettered)
	require.Equal(t, int64(2), h.Retries)
	require.Equal(t, int64(3), h.WriteFailures)
}

func TestPoisonRowsAreDeadAndTheRestPublished(t *testing.T) {
	t.Parallel()
	e := setup(t)
	r := e.relay(t, e.writer(t), relay.Config{MaxMessageBytes: 4096})

	good := []uuid.UUID{
		e.insert(t, topicOrders, "a", 1),
		e.insert(t, topicPayments, "b", 2),
	}
	big := e.insert(t, topicOrders, "a", 3, func(m *store.Message) { m.Payload = make([]byte, 5000) })
	badTopic := e.insert(t, "no spaces allowed", "a", 4)
	setHeaders := func(headers string) uuid.UUID {
		id := e.insert(t, topicOrders, "a", 5)
		_, err := e.pool.Exec(e.ctx, `UPDATE `+pgx.Identifier{e.schema}.Sanitize()+`.outbox SET headers = $2::jsonb WHERE id = $1`,
			id, headers)
		require.NoError(t, err)
		return id
	}
	notString := setHeaders(`{"traceparent": "00-x", "retries": 3}`)
	notObject := setHeaders(`["a", "b"]`)
	jsonNull := setHeaders(`null`)
	good = append(good, e.insert(t, topicOrders, "c", 6))
	// A topic that does not exist fails the whole write in kafka-go; the
	// relay retries topic by topic so that it holds up only its own rows.
	missing := e.insert(t, "no-such-topic", "a", 7)

	published, failed, err := r.RunOnce(e.ctx)
	require.NoError(t, err)
	require.Equal(t, 3, published)
	require.Equal(t, 6, failed)

	for _, id := range good {
		require.Equal(t, store.OutboxPublished, e.row(t, id).Status)
	}
	for id, want := range map[uuid.UUID]string{
		big:       relay.CodeTooLarge + ": message is ",
		badTopic:  relay.CodeInvalidTopic + `: topic "no spaces allowed" is not a legal Kafka topic name`,
		notString: relay.CodeMalformedHeaders + `: headers must be a JSON object of strings: header "retries" is a number, not a string`,
		notObject: relay.CodeMalformedHeaders + ": headers must be a JSON object of strings: got an array",
		jsonNull:  relay.CodeMalformedHeaders + ": headers must be a JSON object of strings: got null",
	} {
		got := e.row(t, id)
		require.Equal(t, store.OutboxDead, got.Status, "row %s", want)
		require.True(t, strings.HasPrefix(got.LastError, want), "last_error %q, want prefix %q", got.LastError, want)
		require.Equal(t, 1, got.Attempts)
	}
	require.Contains(t, e.row(t, big).LastError, "over MaxMessageBytes (4096)")
	got := e.row(t, missing)
	require.Equal(t, store.OutboxPending, got.Status, "an unknown topic may be created later: retried")
	require.Contains(t, got.LastError, "no-such-topic")
	require.Contains(t, got.LastError, "Unknown Topic Or Partition")

	msgs := e.read(t, topicOrders, topicPayments)
	require.Len(t, msgs, 3)
	h, err := r.Health(e.ctx)
	require.NoError(t, err)
	require.Equal(t, int64(5), h.Dead)
	require.Equal(t, int64(1), h.Pending)
}

func TestTwoRelaysPublishEveryRowOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const n = 400
	for i := range n {
		e.insert(t, []string{topicOrders, topicPayments}[i%2], fmt.Sprintf("k%d", i%17), i)
	}
	w := e.writer(t)
	a := e.relay(t, w, relay.Config{BatchSize: 10})
	b := e.relay(t, e.writer(t), relay.Config{BatchSize: 10})
	require.NoError(t, a.Start(e.ctx))
	require.NoError(t, b.Start(e.ctx))
	waitFor(t, 30*time.Second, "every row published", func() bool {
		return e.count(t, store.OutboxPublished) == n
	})
	require.NoError(t, a.Stop(e.ctx))
	require.NoError(t, b.Stop(e.ctx))

	msgs := e.read(t, topicOrders, topicPayments)
	require.Len(t, msgs, n, "no row published twice")
	got := copies(t, msgs)
	require.Len(t, got, n)
	ha, err := a.Health(e.ctx)
	require.NoError(t, err)
	hb, err := b.Health(e.ctx)
	require.NoError(t, err)
	require.Equal(t, int64(n), ha.Published+hb.Published)
	t.Logf("relay a published %d, relay b %d", ha.Published, hb.Published)
}

func TestWakeUps(t *testing.T) {
	t.Parallel()
	e := setup(t)
	r := e.relay(t, e.writer(t), relay.Config{PollInterval: time.Hour})
	require.NoError(t, r.Start(e.ctx))
	// The loop's first cycle finds nothing and waits for an hour, unless
	// something wakes it.
	waitFor(t, 10*time.Second, "the first cycle", func() bool {
		h, err := r.Health(e.ctx)
		require.NoError(t, err)
		return h.Running
	})

	// A notification on the schema's channel.
	tx, err := e.pool.Begin(e.ctx)
	require.NoError(t, err)
	m := &store.Message{ID: uuid.Must(uuid.NewV7()), Topic: topicOrders, AggregateID: "n", Type: "t", Payload: []byte("1")}
	require.NoError(t, e.st.InsertMessage(e.ctx, tx, m))
	require.NoError(t, e.st.Notify(e.ctx, tx, topicOrders))
	require.NoError(t, tx.Commit(e.ctx))
	waitFor(t, 10*time.Second, "the notified row published", func() bool {
		return e.row(t, m.ID).Status == store.OutboxPublished
	})

	// Wake.
	id := e.insert(t, topicOrders, "w", 2)
	r.Wake()
	waitFor(t, 10*time.Second, "the woken row published", func() bool {
		return e.row(t, id).Status == store.OutboxPublished
	})

	// A row written with a delay is published when it comes due.
	delayed := e.insert(t, topicOrders, "d", 3, func(m *store.Message) { m.Delay = 300 * time.Millisecond })
	r.Wake()
	waitFor(t, 10*time.Second, "the delayed row published", func() bool {
		return e.row(t, delayed).Status == store.OutboxPublished
	})
}

func TestStartStopStress(t *testing.T) {
	t.Parallel()
	e := setup(t)
	r := e.relay(t, e.writer(t), relay.Config{BatchSize: 5, PollInterval: 20 * time.Millisecond})
	var inserted atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 150 {
			m := &store.Message{ID: uuid.Must(uuid.NewV7()), Topic: topicOrders, AggregateID: fmt.Sprint(i % 7),
				Type: "t", Payload: []byte("x")}
			if err := e.st.InsertMessage(e.ctx, e.pool, m); err != nil {
				t.Errorf("insert: %v", err)
				return
			}
			inserted.Add(1)
		}
	}()

	for round := range 25 {
		errs := make(chan error, 8)
		for g := range 4 {
			go func() {
				switch (round + g) % 4 {
				case 0, 1:
					errs <- r.Start(e.ctx)
					errs <- nil
				case 2:
					errs <- r.Stop(e.ctx)
					errs <- nil
				default:
					ctx, cancel := contextWithExpiredDeadline(e.ctx)
					defer cancel()
					errs <- r.Start(e.ctx)
					err := r.Stop(ctx)
					if err != nil && !errors.Is(err, ctx.Err()) {
						errs <- err
						return
					}
					errs <- nil
				}
			}()
		}
		for range 8 {
			if err := <-errs; err != nil && !errors.Is(err, lifecycle.ErrStopping) {
				require.NoError(t, err)
			}
		}
		if round%5 == 4 {
			require.NoError(t, r.StopAndCancel(e.ctx))
		}
	}
	<-done
	require.NoError(t, r.Start(e.ctx))
	require.NoError(t, r.Start(e.ctx), "Start on a running relay does nothing")
	waitFor(t, 20*time.Second, "every row published", func() bool {
		return e.count(t, store.OutboxPublished) == int(inserted.Load())
	})
	require.NoError(t, r.Stop(e.ctx))
	require.NoError(t, r.Stop(e.ctx), "Stop on a stopped relay")
	// Cancelled batches may have reached the broker before their rows were
	// marked: at least once, never lost.
	got := copies(t, e.read(t, topicOrders))
	require.Len(t, got, int(inserted.Load()))
	h, err := r.Health(e.ctx)
	require.NoError(t, err)
	require.False(t, h.Running)
}

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	e := setup(t)
	w := &fakeWriter{}
	for _, tc := range []struct {
		cfg  relay.Config
		want string
	}{
		{relay.Config{Schema: "bad schema"}, "Schema"},
		{relay.Config{BatchSize: -1}, "BatchSize"},
		{relay.Config{BatchSize: relay.BatchSizeMax + 1}, "BatchSize"},
		{relay.Config{PollInterval: -time.Second}, "PollInterval"},
		{relay.Config{MaxAttempts: -1}, "MaxAttempts"},
		{relay.Config{MaxMessageBytes: -1}, "MaxMessageBytes"},
		{relay.Config{PublishTimeout: -1}, "PublishTimeout"},
		{relay.Config{PublishTimeout: time.Nanosecond}, "PublishTimeoutMin"},
		{relay.Config{PublishTimeout: relay.PublishTimeoutMin - 1}, "PublishTimeoutMin"},
	} {
		_, err := relay.New(e.pool, w, &tc.cfg)
		require.ErrorIs(t, err, relay.ErrInvalidConfig)
		require.ErrorContains(t, err, tc.want)
	}
	_, err := relay.New(nil, w, nil)
	require.ErrorIs(t, err, relay.ErrInvalidConfig)
	_, err = relay.New(e.pool, nil, nil)
	require.ErrorIs(t, err, relay.ErrInvalidConfig)
	r, err := relay.New(e.pool, w, nil)
	require.NoError(t, err, "nil config means the defaults")
	require.NoError(t, r.Stop(e.ctx))
}

func TestDefaultBackoff(t *testing.T) {
	t.Parallel()
	for attempt := range 40 {
		d := relay.DefaultBackoff(attempt + 1)
		want := min(time.Second<<min(attempt, 20), 5*time.Minute)
		require.GreaterOrEqual(t, d, want*8/10, "attempt %d", attempt+1)
		require.LessOrEqual(t, d, min(want*12/10, 5*time.Minute), "attempt %d", attempt+1)
	}
	require.Positive(t, relay.DefaultBackoff(0))
}

// A row written for later (a retry, a held command) comes due between the
// relay's last claim and its look ahead. The look counted only rows
// due later, took this one for a row another relay held, and slept for
// PollInterval: a minute here. It now counts what came due since the drain
// began.
func TestARowDueBetweenTheClaimAndTheLookIsPublishedAtOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	r := e.relay(t, e.writer(t), relay.Config{PollInterval: time.Minute})
	outbox := pgx.Identifier{e.schema, "outbox"}.Sanitize()
	later := e.insert(t, topicOrders, "later", 1, func(m *store.Message) { m.Delay = time.Hour })
	var due atomic.Int64 // when later is due (unix ns); 0: not armed
	var slowed atomic.Bool
	relay.SetAfterClaim(r, func(int) {
		if at := due.Load(); at != 0 && slowed.CompareAndSwap(false, true) {
			// The look comes after the row is due, as on a loaded machine.
			time.Sleep(time.Until(time.Unix(0, at).Add(200 * time.Millisecond)))
		}
	})
	require.NoError(t, r.Start(e.ctx))
	// The listener's connect wakes the loop: let it come first.
	waitFor(t, 10*time.Second, "the relay to listen", func() bool { return relay.Listening(r) })
	time.Sleep(200 * time.Millisecond)

	// Due in 300 ms; the loop slept for a minute before it was.
	due.Store(time.Now().Add(300 * time.Millisecond).UnixNano())
	_, err := e.pool.Exec(e.ctx, "UPDATE "+outbox+" SET available_at = now() + interval '300 ms' WHERE id = $1", later)
	require.NoError(t, err)
	// Another row wakes the loop, which drains before later is due.
	now := e.insert(t, topicOrders, "now", 2)
	r.Wake()
	waitFor(t, 10*time.Second, "the row due now published", func() bool { return e.row(t, now).Published })
	waitFor(t, 10*time.Second, "the row due later published", func() bool { return e.row(t, later).Published })
	require.True(t, slowed.Load(), "the relay's look was not slowed")
}

// A drain that ends short asks when the next row comes due in the round
// trip that ends its last claim's transaction (the marks and COMMIT, or
// the ROLLBACK of a claim that found nothing), not in one of its own: an
// idle relay's cycle over one row is two round trips. Counted on the wire.
func TestAShortDrainLooksAheadInTheRoundTripThatEndsIt(t *testing.T) {
	t.Parallel()
	e := setup(t)
	traced, trace := pgtest.Traced(t, e.pool, 4)
	r, err := relay.New(traced, e.writer(t), &relay.Config{Schema: e.schema, PollInterval: time.Minute, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, r.Start(e.ctx))
	waitFor(t, 10*time.Second, "the relay to listen", func() bool { return relay.Listening(r) })
	for i := range 3 {
		id := e.insert(t, topicOrders, "k", i)
		r.Wake()
		waitFor(t, 10*time.Second, "the row published", func() bool { return e.row(t, id).Published })
	}
	stop, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, r.Stop(stop))

	looks, withCommit, withRollback := 0, 0, 0
	for _, rt := range trace.All() {
		look := false
		for _, s := range rt.Stmts {
			look = look || strings.Contains(s, "min(available_at)")
		}
		if !look {
			continue
		}
		looks++
		require.Greater(t, len(rt.Stmts), 1, "a look ahead in a round trip of its own: %q", rt.Stmts)
		last := rt.Stmts[len(rt.Stmts)-1]
		switch {
		case pgtest.IsStmt(last, "COMMIT"):
			withCommit++
		case pgtest.IsStmt(last, "ROLLBACK"):
			withRollback++
		default:
			t.Fatalf("a look ahead not ended by COMMIT or ROLLBACK: %q", rt.Stmts)
		}
	}
	require.GreaterOrEqual(t, withCommit, 3, "each drain that published a row looked with its COMMIT (%d looks, %d with a ROLLBACK)",
		looks, withRollback)
}
