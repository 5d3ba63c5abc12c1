package saga_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/saga"
)

// deadBundle is an engine with dead outbox rows and dead letters.
type deadBundle struct {
	*bundle
	st       *store.Store
	messages []uuid.UUID // dead outbox rows: orders, payments, orders
	letters  []int64     // dead letters: billing/orders, shipping/orders, billing/payments
	badKey   int64       // a dead letter whose key the outbox cannot hold
}

func setupDead(t *testing.T) *deadBundle {
	t.Helper()
	ctx := context.Background()
	b := &deadBundle{bundle: setup(t, nil)}
	var err error
	b.st, err = store.New(b.schema)
	require.NoError(t, err)
	for _, topic := range []string{"orders", "payments", "orders"} {
		m := &store.Message{ID: uuid.Must(uuid.NewV7()), Topic: topic, AggregateID: "k", Type: "t", Payload: []byte("p")}
		require.NoError(t, b.st.InsertMessage(ctx, b.pool, m))
		require.NoError(t, b.st.MarkFailed(ctx, b.pool, []store.RelayFailure{{ID: m.ID, Err: "message_too_large: no", Dead: true}}))
		b.messages = append(b.messages, m.ID)
	}
	letter := func(consumer, topic string, key []byte) int64 {
		p, o := 0, int64(len(b.letters))
		require.NoError(t, b.st.InsertDeadLetter(ctx, b.pool, &store.DeadLetter{Consumer: consumer, MessageID: uuid.NewString(),
			Topic: topic, Partition: &p, Offset: &o, Key: key, Value: []byte("v"), Reason: "refused"}))
		var id int64
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT max(id) FROM `+b.table("dead_letters")).Scan(&id))
		b.letters = append(b.letters, id)
		return id
	}
	letter("billing", "orders", []byte("a"))
	letter("shipping", "orders", []byte("b"))
	letter("billing", "payments", nil)
	b.badKey = letter("billing", "orders", []byte{0xff})
	b.letters = b.letters[:3]
	return b
}

func (b *deadBundle) outboxStatus(t *testing.T, id uuid.UUID) string {
	t.Helper()
	var s string
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT status FROM `+b.table("outbox")+` WHERE id = $1`, id).Scan(&s))
	return s
}

func TestDeadListings(t *testing.T) {
	t.Parallel()
	b := setupDead(t)
	ctx := context.Background()

	msgs, err := b.engine.DeadMessages(ctx, nil)
	require.NoError(t, err)
	require.Len(t, msgs.Messages, 3)
	require.Empty(t, msgs.NextCursor)
	require.Equal(t, b.messages[0], msgs.Messages[0].ID, "oldest first")
	require.Equal(t, "message_too_large: no", msgs.Messages[0].LastError)
	require.Equal(t, "relay", msgs.Messages[0].Delivery)

	page, err := b.engine.DeadMessages(ctx, &saga.DeadOpts{Topic: "orders", Limit: 1})
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{b.messages[0]}, []uuid.UUID{page.Messages[0].ID})
	page, err = b.engine.DeadMessages(ctx, &saga.DeadOpts{Topic: "orders", Limit: 1, Cursor: page.NextCursor})
	require.NoError(t, err)
	require.Equal(t, b.messages[2], page.Messages[0].ID)
	require.Empty(t, page.NextCursor)

	letters, err := b.engine.DeadLetters(ctx, &saga.DeadOpts{Consumer: "billing"})
	require.NoError(t, err)
	require.Len(t, letters.Letters, 3)
	require.Equal(t, b.letters[0], letters.Letters[0].ID)
	require.Equal(t, []byte("a"), letters.Letters[0].Key)
	require.Equal(t, 1, letters.Letters[0].ValueBytes)
	letters, err = b.engine.DeadLetters(ctx, &saga.DeadOpts{Topic: "orders"})
	require.NoError(t, err)
	require.Len(t, letters.Letters, 3)

	for _, opts := range []*saga.DeadOpts{{Consumer: "billing"}, {Limit: -1}, {Limit: saga.ListLimitMax + 1}} {
		_, err := b.engine.DeadMessages(ctx, opts)
		require.Error(t, err, "%+v", opts)
	}

	st, err := b.engine.OutboxStatus(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(3), st.Dead)
	require.Equal(t, int64(4), st.DeadLetters)
}

func TestRequeueDeadByID(t *testing.T) {
	t.Parallel()
	b := setupDead(t)
	ctx := context.Background()
	missing := uuid.Must(uuid.NewV7())
	opts := &saga.RequeueOpts{
		MessageIDs: []uuid.UUID{b.messages[0], missing},
		LetterIDs:  []int64{b.letters[0], b.badKey, b.letters[2]},
		DryRun:     true,
	}

	// A dry run reports what would happen and changes nothing.
	res, err := b.engine.RequeueDead(ctx, opts)
	require.NoError(t, err)
	require.True(t, res.DryRun)
	require.Equal(t, []uuid.UUID{b.messages[0]}, res.Messages)
	require.Len(t, res.Letters, 2)
	require.Len(t, res.Failed, 2)
	require.Equal(t, store.OutboxDead, b.outboxStatus(t, b.messages[0]))
	st, err := b.engine.OutboxStatus(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(3), st.Dead)
	require.Equal(t, int64(4), st.DeadLetters)
	var outbox int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM `+b.table("outbox")).Scan(&outbox))
	require.Equal(t, 3, outbox, "no row written")

	opts.DryRun = false
	res, err = b.engine.RequeueDead(ctx, opts)
	require.NoError(t, err)
	require.False(t, res.DryRun)
	require.Equal(t, []uuid.UUID{b.messages[0]}, res.Messages)
	require.Equal(t, store.OutboxPending, b.outboxStatus(t, b.messages[0]))
	require.Len(t, res.Letters, 2)
	for i, l := range res.Letters {
		require.Equal(t, []int64{b.letters[0], b.letters[2]}[i], l.ID)
		require.Equal(t, store.OutboxPending, b.outboxStatus(t, l.OutboxID))
		require.NotEmpty(t, l.MessageID)
	}
	require.Len(t, res.Failed, 2, "the rest went on")
	require.Equal(t, saga.DeadOutbox, res.Failed[0].Kind)
	require.Equal(t, missing.String(), res.Failed[0].ID)
	require.EqualError(t, res.Failed[0].Err, "saga: outbox message "+missing.String()+" cannot be requeued: no such outbox message")
	require.Equal(t, saga.DeadLetters, res.Failed[1].Kind)
	require.Equal(t, strconv.FormatInt(b.badKey, 10), res.Failed[1].ID)
	require.ErrorIs(t, res.Failed[1].Err, store.ErrNotRequeueable)
	require.EqualError(t, res.Failed[1].Err, "store: dead letter "+strconv.FormatInt(b.badKey, 10)+
		" cannot be requeued: its key is not valid UTF-8, and the outbox keeps the Kafka key as text")

	st, err = b.engine.OutboxStatus(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(2), st.Dead)
	require.Equal(t, int64(2), st.DeadLetters)
	require.Equal(t, int64(3), st.Pending)

	// Twice: nothing left to requeue.
	opts.MessageIDs, opts.LetterIDs = opts.MessageIDs[:1], opts.LetterIDs[:1]
	res, err = b.engine.RequeueDead(ctx, opts)
	require.NoError(t, err)
	require.Empty(t, res.Messages)
	require.Empty(t, res.Letters)
	require.Len(t, res.Failed, 2)
	require.ErrorContains(t, res.Failed[0].Err, "cannot be requeued: its status is pending, not dead")
	require.ErrorContains(t, res.Failed[1].Err, "requeued already at ")
}

func TestRequeueDeadByFilter(t *testing.T) {
	t.Parallel()
	b := setupDead(t)
	ctx := context.Background()

	res, err := b.engine.RequeueDead(ctx, &saga.RequeueOpts{All: true, Kind: saga.DeadOutbox, Topic: "orders", Max: 1})
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{b.messages[0]}, res.Messages, "the oldest, at most Max")
	require.Equal(t, store.OutboxDead, b.outboxStatus(t, b.messages[2]))

	// Consumer implies dead letters.
	res, err = b.engine.RequeueDead(ctx, &saga.RequeueOpts{All: true, Consumer: "billing"})
	require.NoError(t, err)
	require.Empty(t, res.Messages)
	var got []int64
	for _, l := range res.Letters {
		got = append(got, l.ID)
		require.Equal(t, "billing", l.Consumer)
	}
	require.Equal(t, []int64{b.letters[0], b.letters[2]}, got)
	require.Len(t, res.Failed, 1)
	require.Equal(t, strconv.FormatInt(b.badKey, 10), res.Failed[0].ID)

	left, err := b.engine.DeadLetters(ctx, nil)
	require.NoError(t, err)
	require.Len(t, left.Letters, 2, "shipping's letter and the one that cannot be requeued")
	all, err := b.engine.DeadLetters(ctx, &saga.DeadOpts{IncludeRequeued: true})
	require.NoError(t, err)
	require.Len(t, all.Letters, 4)
}

func TestRequeueDeadRefusesUnclearSelections(t *testing.T) {
	t.Parallel()
	b := setupDead(t)
	ctx := context.Background()
	id := uuid.Must(uuid.NewV7())
	for want, opts := range map[string]*saga.RequeueOpts{
		"nothing selected":                nil,
		"give ids or All, not both":       {All: true, Kind: saga.DeadOutbox, MessageIDs: []uuid.UUID{id}},
		"All needs a Kind":                {All: true, Topic: "orders"},
		`unknown Kind "x"`:                {All: true, Kind: "x"},
		"outbox rows have no consumer":    {All: true, Kind: saga.DeadOutbox, Consumer: "billing"},
		"Max -1 is outside":               {All: true, Kind: saga.DeadOutbox, Max: -1},
		"select with All only":            {MessageIDs: []uuid.UUID{id}, Topic: "orders"},
		"Max 10001 is outside 0..10000":   {All: true, Kind: saga.DeadLetters, Max: saga.RequeueMaxLimit + 1},
		"10001 ids, more than 10000":      {LetterIDs: make([]int64, saga.RequeueMaxLimit+1)},
		"select with All only (and Kind)": {LetterIDs: []int64{1}, Kind: saga.DeadLetters},
	} {
		_, err := b.engine.RequeueDead(ctx, opts)
		require.Error(t, err, want)
		require.Contains(t, err.Error(), stripParen(want), want)
	}
}

func stripParen(s string) string {
	for i := range s {
		if s[i] == '(' && i > 0 {
			return s[:i-1]
		}
	}
	return s
}

// A requeued command of a saga is recorded in the saga's history, with the
// reason (who asked); a dry run records nothing.
func TestRequeueDeadRecordsItInTheSagasHistory(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	def := threeSteps(b, "requeued", nil)
	require.NoError(t, b.engine.Register(def))
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, order{}, nil) // not started: its first command waits
	require.NoError(t, err)
	var cmd uuid.UUID
	require.NoError(t, b.pool.QueryRow(ctx, `UPDATE `+b.table("outbox")+` SET status = 'dead', last_error = 'parked by hand'
		WHERE saga_id = $1 RETURNING id`, st.ID).Scan(&cmd))
	events := func() int {
		return b.count(t, `SELECT count(*) FROM `+b.table("saga_history")+` WHERE saga_id = $1 AND event = $2`, st.ID, saga.EventCommandRequeued)
	}
	_, err = b.engine.RequeueDead(ctx, &saga.RequeueOpts{MessageIDs: []uuid.UUID{cmd}, DryRun: true, Reason: "by anna"})
	require.NoError(t, err)
	require.Zero(t, events(), "a dry run records nothing")
	res, err := b.engine.RequeueDead(ctx, &saga.RequeueOpts{MessageIDs: []uuid.UUID{cmd}, Reason: "by anna: the provider is back"})
	require.NoError(t, err)
	require.Equal(t, []uuid.UUID{cmd}, res.Messages)
	in, err := b.engine.Get(ctx, st.ID)
	require.NoError(t, err)
	var found bool
	for _, ev := range in.History {
		if ev.Type == saga.EventCommandRequeued {
			found = true
			require.Contains(t, string(ev.Detail), "by anna: the provider is back")
			require.Contains(t, string(ev.Detail), cmd.String())
		}
	}
	require.True(t, found, "the requeue is in the saga's history")
	b.start(t)
	require.Equal(t, saga.StatusCompleted, b.waitTerminal(t, st.ID).Status, "the requeued command ran")
}
