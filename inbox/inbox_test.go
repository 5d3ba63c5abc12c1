package inbox_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/outbox"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type bundle struct {
	pool   *pgxpool.Pool
	schema string
	in     *inbox.Inbox
}

func setup(t testing.TB) *bundle {
	t.Helper()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, "CREATE TABLE "+pgx.Identifier{schema, "charges"}.Sanitize()+" (message_id text, amount int)")
	require.NoError(t, err)
	in, err := inbox.New(pool, &inbox.Config{Consumer: "payments", Schema: schema})
	require.NoError(t, err)
	return &bundle{pool: pool, schema: schema, in: in}
}

func (b *bundle) table(name string) string { return pgx.Identifier{b.schema, name}.Sanitize() }

func (b *bundle) count(t *testing.T, q string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), q, args...).Scan(&n))
	return n
}

// charge is a handler with a database effect: one row per call.
func (b *bundle) charge(calls *atomic.Int32) inbox.HandlerFunc {
	return func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
		calls.Add(1)
		_, err := tx.Exec(ctx, "INSERT INTO "+b.table("charges")+" VALUES ($1, 10)", msg.ID)
		return err
	}
}

func TestDuplicateHasNoSecondEffect(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	var calls atomic.Int32
	msg := inbox.Message{ID: "m-1", Type: "charge.requested"}
	ok, err := b.in.Process(ctx, msg, b.charge(&calls))
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = b.in.Process(ctx, msg, b.charge(&calls))
	require.NoError(t, err)
	require.False(t, ok, "a duplicate is skipped")
	require.Equal(t, int32(1), calls.Load())
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("charges")))

	// Another consumer processes the same message once for itself.
	other, err := inbox.New(b.pool, &inbox.Config{Consumer: "ledger", Schema: b.schema})
	require.NoError(t, err)
	ok, err = other.Process(ctx, msg, b.charge(&calls))
	require.NoError(t, err)
	require.True(t, ok)
}

func TestConcurrentDuplicatesRunOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var calls atomic.Int32
	var wg sync.WaitGroup
	var processed atomic.Int32
	for range 8 {
		wg.Go(func() {
			ok, err := b.in.Process(context.Background(), inbox.Message{ID: "same"}, b.charge(&calls))
			require.NoError(t, err)
			if ok {
				processed.Add(1)
			}
		})
	}
	wg.Wait()
	require.Equal(t, int32(1), processed.Load())
	require.Equal(t, int32(1), calls.Load(), "the handler ran once: the others waited on the first record and skipped")
	require.Equal(t, 1, b.count(t, "SELECT count(*) FROM "+b.table("charges")))
}

func TestFailedHandlerRecordsNothing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	boom := errors.New("ledger unavailable")
	_, err := b.in.Process(ctx, inbox.Message{ID: "m-2"}, func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
		if _, err := tx.Exec(ctx, "INSERT INTO "+b.table("charges")+" VALUES ($1, 10)", msg.ID); err != nil {
			return err
		}
		return boom
	})
	require.ErrorIs(t, err, boom)
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("charges")), "the effect rolled back")
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("inbox")), "the id is not recorded")
	var calls atomic.Int32
	ok, err := b.in.Process(ctx, inbox.Message{ID: "m-2"}, b.charge(&calls))
	require.NoError(t, err)
	require.True(t, ok, "so the message can be processed again")
}

func TestProcessTxJoinsTheCallersTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	var calls atomic.Int32
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	ok, err := b.in.ProcessTx(ctx, tx, inbox.Message{ID: "m-3"}, b.charge(&calls))
	require.NoError(t, err)
	require.True(t, ok)
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, 0, b.count(t, "SELECT count(*) FROM "+b.table("inbox")), "rolled back with the caller")
	_, err = b.in.ProcessTx(ctx, nil, inbox.Message{}, b.charge(&calls))
	require.ErrorContains(t, err, "message has no id")
}

func TestDeadLetterKeepsTheOriginalBytesOnce(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	msg := inbox.Message{ID: "bad", Topic: "payments", Partition: 2, Offset: 41, Key: []byte("k"),
		Value: []byte{0xff, 0x00, '{'}, Headers: map[string]string{"x": "a\x00b\xff"}}
	ok, err := b.in.DeadLetter(ctx, msg, "malformed: invalid character")
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = b.in.DeadLetter(ctx, msg, "again")
	require.NoError(t, err)
	require.False(t, ok, "a redelivered poison message is not dead-lettered twice")
	var value []byte
	var reason, header string
	var partition int
	var offset int64
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT msg_value, reason, headers->>'x', kafka_partition, kafka_offset FROM "+b.table("dead_letters")).
		Scan(&value, &reason, &header, &partition, &offset))
	require.Equal(t, msg.Value, value)
	require.Equal(t, "malformed: invalid character", reason)
	require.Equal(t, `a\0b`+"\uFFFD", header, "headers made storable")
	require.Equal(t, 2, partition)
	require.Equal(t, int64(41), offset)
}

func TestConfigErrors(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := inbox.New(b.pool, &inbox.Config{})
	require.ErrorIs(t, err, inbox.ErrInvalidConfig)
	require.ErrorContains(t, err, "Consumer is required")
	_, err = inbox.New(b.pool, &inbox.Config{Consumer: "c", Schema: "bad;schema"})
	require.ErrorContains(t, err, "Schema")
	_, err = b.in.NewConsumer(nil, &inbox.ConsumerConfig{})
	require.ErrorContains(t, err, "reader is nil")
}

// A handler that writes an outbox row inside Process wakes the relay after
// Process commits (a notification on the schema's channel), not inside its
// transaction, where it would keep the commit from sharing a WAL flush.
func TestProcessWakesTheRelayAfterItsCommit(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	ob, err := outbox.New(b.pool, b.schema)
	require.NoError(t, err)
	listener, err := b.pool.Acquire(ctx)
	require.NoError(t, err)
	defer listener.Release()
	// The schema's channel, as the relay listens to it.
	_, err = listener.Exec(ctx, "LISTEN "+pgx.Identifier{b.schema + "_sagaflow"}.Sanitize())
	require.NoError(t, err)

	var inTx atomic.Int64 // outbox rows the handler's transaction saw
	fresh, err := b.in.Process(ctx, inbox.Message{ID: "m-wake", Topic: "orders"}, func(ctx context.Context, tx pgx.Tx, _ inbox.Message) error {
		if err := ob.InsertTx(ctx, tx, outbox.Message{Topic: "payments.replies", Key: "k", Type: "paid", Payload: []byte("{}")}); err != nil {
			return err
		}
		var n int64
		if err := tx.QueryRow(ctx, "SELECT count(*) FROM "+b.table("outbox")).Scan(&n); err != nil {
			return err
		}
		inTx.Store(n)
		return nil
	})
	require.NoError(t, err)
	require.True(t, fresh)
	require.Equal(t, int64(1), inTx.Load())
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	n, err := listener.Conn().WaitForNotification(wctx)
	require.NoError(t, err, "the relay was not woken after the commit")
	require.Equal(t, "payments.replies", n.Payload)
}
