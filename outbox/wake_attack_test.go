package outbox_test

import (
	"context"
	"io"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
)

// Attacks on WakeAfterCommit with two schemas in one transaction: the wake
// must reach the relay of each schema the transaction wrote to, and be
// harmless when there is nothing to wake for.

// recWriter is a relay.Writer that keeps what it is given, in memory. (The
// relay's own fake writer, which its conformance suite checks against
// kafka-go, is in package relay_test, out of reach here; this one only
// records, which is all these tests ask of a broker.)
type recWriter struct {
	mu   sync.Mutex
	msgs []kafka.Message
}

func (w *recWriter) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.msgs = append(w.msgs, msgs...)
	return nil
}

func (w *recWriter) Close() error { return nil }

// ids returns the message id header of every message written, in order.
func (w *recWriter) ids() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for _, m := range w.msgs {
		for _, h := range m.Headers {
			if h.Key == store.HeaderMessageID {
				out = append(out, string(h.Value))
			}
		}
	}
	return out
}

// has reports whether every id was written.
func (w *recWriter) has(ids ...uuid.UUID) bool {
	got := w.ids()
	for _, id := range ids {
		if !slices.Contains(got, id.String()) {
			return false
		}
	}
	return true
}

// tenant is one schema with its outbox and a running relay.
type tenant struct {
	pool   *pgxpool.Pool
	schema string
	ob     *outbox.Outbox
	w      *recWriter
	r      *relay.Relay
}

// newTenant migrates a schema and runs a relay on it that polls every poll,
// once its LISTEN connection is in place.
func newTenant(t *testing.T, poll time.Duration) *tenant {
	t.Helper()
	pool, schema, ob := newOutbox(t)
	w := &recWriter{}
	r, err := relay.New(pool, w, &relay.Config{Schema: schema, PollInterval: poll,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, r.Stop(ctx))
	})
	waitUntil(t, 10*time.Second, "the relay's LISTEN connection", func() bool {
		for _, c := range r.Check(context.Background()).Checks {
			if c.Name == "listen" {
				return c.OK
			}
		}
		return false
	})
	return &tenant{pool: pool, schema: schema, ob: ob, w: w, r: r}
}

// pending counts the rows still pending among ids.
func (tn *tenant) pending(t *testing.T, ids ...uuid.UUID) int {
	t.Helper()
	var n int
	require.NoError(t, tn.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+
		pgx.Identifier{tn.schema, "outbox"}.Sanitize()+" WHERE id = ANY($1) AND status = 'pending'", ids).Scan(&n))
	return n
}

func waitUntil(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(timeout); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
	}
}

// channelListener listens to the channels of some schemas on a connection
// of its own.
type channelListener struct {
	conn     *pgxpool.Conn
	pool     *pgxpool.Pool
	channels map[string]string // channel → schema
	mark     string
}

func listenTo(t *testing.T, pool *pgxpool.Pool, tenants ...*tenant) *channelListener {
	t.Helper()
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	t.Cleanup(conn.Release)
	l := &channelListener{conn: conn, pool: pool, channels: map[string]string{}, mark: tenants[0].schema + "_test_mark"}
	for _, tn := range tenants {
		st, err := store.New(tn.schema)
		require.NoError(t, err)
		l.channels[st.Channel()] = tn.schema
	}
	for ch := range l.channels {
		_, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{ch}.Sanitize())
		require.NoError(t, err)
	}
	_, err = conn.Exec(ctx, "LISTEN "+pgx.Identifier{l.mark}.Sanitize())
	require.NoError(t, err)
	return l
}

// heard returns, by schema, how many notifications its channel got from
// transactions that committed before this call. It commits a mark and
// reads up to it: PostgreSQL delivers notifications in commit order, so
// nothing needs a timeout to be shown absent.
func (l *channelListener) heard(t *testing.T) map[string]int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	tag := uuid.NewString()
	_, err := l.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, l.mark, tag)
	require.NoError(t, err)
	out := map[string]int{}
	for {
		n, err := l.conn.Conn().WaitForNotification(ctx)
		require.NoError(t, err, "the mark never came")
		if n.Channel == l.mark && n.Payload == tag {
			return out
		}
		if schema, ok := l.channels[n.Channel]; ok {
			out[schema]++
		}
	}
}

func message(key string) outbox.Message {
	return outbox.Message{ID: uuid.Must(uuid.NewV7()), Topic: "orders.events", Key: key, Type: "OrderPaid", Payload: []byte(`{}`)}
}

// insertBoth writes, in one transaction on a's pool under ctx, a message
// into a's outbox and one into b's (the same topic: each schema's wake-up
// must survive the other's), and commits or rolls back.
func insertBoth(t *testing.T, ctx context.Context, a, b *tenant, commit bool) (idA, idB uuid.UUID) {
	t.Helper()
	ma, mb := message("a"), message("b")
	tx, err := a.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	require.NoError(t, a.ob.InsertTx(ctx, tx, ma))
	require.NoError(t, b.ob.InsertTx(ctx, tx, mb))
	if commit {
		require.NoError(t, tx.Commit(ctx))
	}
	return ma.ID, mb.ID
}

// One transaction writes into the outboxes of two schemas under one
// WakeAfterCommit context. Its commit notifies no one; wake, after it,
// wakes the relays of both schemas, which poll only once a minute, so only
// the notification explains a publish within seconds. A second wake sends
// nothing.
func TestWakeAfterCommitWakesTheRelayOfEachSchema(t *testing.T) {
	t.Parallel()
	a, b := newTenant(t, time.Minute), newTenant(t, time.Minute)
	require.NotEqual(t, a.schema, b.schema)
	l := listenTo(t, a.pool, a, b)

	var idA, idB uuid.UUID
	var allA, allB []string // every try's rows: a start-up cycle publishes an earlier try's
	var wake func(context.Context, outbox.Execer) error
	// The relays each ran a cycle when they started and one when their
	// LISTEN came up. Should a cycle still be on its way when the
	// transaction commits, it takes the rows, and a wake-up would have
	// nothing to show: the transaction is then tried again with new rows.
	// Nothing else wakes the relays, so one more try is enough.
	for try := 0; ; try++ {
		ctx, w := outbox.WakeAfterCommit(context.Background())
		idA, idB = insertBoth(t, ctx, a, b, true)
		allA, allB = append(allA, idA.String()), append(allB, idB.String())
		require.Empty(t, l.heard(t), "the commit notified, under WakeAfterCommit")
		if a.pending(t, idA) == 1 && b.pending(t, idB) == 1 {
			wake = w
			break
		}
		require.Less(t, try, 2, "the relays publish without being woken")
		t.Logf("a relay's start-up cycle took the rows; again")
	}

	require.NoError(t, wake(context.Background(), a.pool))
	waitUntil(t, 10*time.Second, "A's relay to publish A's row", func() bool { return a.w.has(idA) })
	waitUntil(t, 10*time.Second, "B's relay to publish B's row", func() bool { return b.w.has(idB) })
	require.Equal(t, map[string]int{a.schema: 1, b.schema: 1}, l.heard(t), "one notification per schema")
	require.NotContains(t, a.w.ids(), idB.String(), "A's relay published B's row")
	require.NotContains(t, b.w.ids(), idA.String(), "B's relay published A's row")

	// Twice is harmless: nothing is left to send.
	require.NoError(t, wake(context.Background(), a.pool))
	require.Empty(t, l.heard(t))
	waitUntil(t, 10*time.Second, "the rows to be marked", func() bool { return a.pending(t, idA)+b.pending(t, idB) == 0 })
	require.ElementsMatch(t, allA, a.w.ids(), "each of A's rows once")
	require.ElementsMatch(t, allB, b.w.ids(), "each of B's rows once")
}

// A rolled-back transaction's recorded wake-up finds nothing to publish:
// wake does not fail, twice, and nothing is published; the relays go on
// publishing what comes after.
func TestWakeAfterARollbackPublishesNothing(t *testing.T) {
	t.Parallel()
	a, b := newTenant(t, time.Minute), newTenant(t, time.Minute)
	ctx, wake := outbox.WakeAfterCommit(context.Background())
	idA, idB := insertBoth(t, ctx, a, b, false)
	require.NoError(t, wake(context.Background(), a.pool))
	require.NoError(t, wake(context.Background(), a.pool))
	require.Zero(t, count(t, a.pool, a.schema))
	require.Zero(t, count(t, b.pool, b.schema))

	// A row written after, with a notification in its transaction, is
	// published; by then each relay has run the cycles the wake caused.
	nextA, nextB := message("a"), message("b")
	require.NoError(t, pgx.BeginFunc(context.Background(), a.pool, func(tx pgx.Tx) error {
		if err := a.ob.InsertTx(context.Background(), tx, nextA); err != nil {
			return err
		}
		return b.ob.InsertTx(context.Background(), tx, nextB)
	}))
	waitUntil(t, 10*time.Second, "the next rows to be published", func() bool { return a.w.has(nextA.ID) && b.w.has(nextB.ID) })
	require.Equal(t, []string{nextA.ID.String()}, a.w.ids(), "A's relay published something of the rolled-back transaction")
	require.Equal(t, []string{nextB.ID.String()}, b.w.ids(), "B's relay published something of the rolled-back transaction")
	require.NotEqual(t, idA, nextA.ID)
	require.NotEqual(t, idB, nextB.ID)
}

// A wake whose context is cancelled fails, with the context's error, and
// notifies no one; the rows are safe and the relays publish them at their
// next poll, as WakeAfterCommit's documentation says.
func TestWakeWithACancelledContextOnlyDelays(t *testing.T) {
	t.Parallel()
	const poll = 200 * time.Millisecond
	a, b := newTenant(t, poll), newTenant(t, poll)
	l := listenTo(t, a.pool, a, b)
	ctx, wake := outbox.WakeAfterCommit(context.Background())
	idA, idB := insertBoth(t, ctx, a, b, true)

	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	err := wake(cancelled, a.pool)
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorContains(t, err, "outbox: ")
	require.Empty(t, l.heard(t), "a cancelled wake notified")

	waitUntil(t, 10*time.Second, "the relays' poll to publish both rows", func() bool { return a.w.has(idA) && b.w.has(idB) })
	waitUntil(t, 10*time.Second, "the rows to be marked", func() bool { return a.pending(t, idA)+b.pending(t, idB) == 0 })
	require.Equal(t, []string{idA.String()}, a.w.ids())
	require.Equal(t, []string{idB.String()}, b.w.ids())
}

// A wake that failed sends, when called again, what it failed to send:
// wake reporting success while the relays were told nothing would leave
// the rows to the next poll (here a minute away) behind the caller's back.
func TestWakeCalledAgainAfterAFailureSendsWhatFailed(t *testing.T) {
	t.Parallel()
	a, b := newTenant(t, time.Minute), newTenant(t, time.Minute)
	l := listenTo(t, a.pool, a, b)
	var idA, idB uuid.UUID
	var wake func(context.Context, outbox.Execer) error
	for try := 0; ; try++ { // see TestWakeAfterCommitWakesTheRelayOfEachSchema
		ctx, w := outbox.WakeAfterCommit(context.Background())
		idA, idB = insertBoth(t, ctx, a, b, true)
		if a.pending(t, idA) == 1 && b.pending(t, idB) == 1 {
			wake = w
			break
		}
		require.Less(t, try, 2, "the relays publish without being woken")
	}

	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, wake(cancelled, a.pool), context.Canceled)
	require.Empty(t, l.heard(t))
	require.NoError(t, wake(context.Background(), a.pool))
	require.Equal(t, map[string]int{a.schema: 1, b.schema: 1}, l.heard(t), "the wake called again sent nothing")
	waitUntil(t, 10*time.Second, "both relays to publish", func() bool { return a.w.has(idA) && b.w.has(idB) })
}
