package main

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

type outboxStatusDoc struct {
	Pending                 int64   `json:"pending"`
	OldestPendingAgeSeconds float64 `json:"oldest_pending_age_seconds"`
	Dead                    int64   `json:"dead"`
	DeadLetters             int64   `json:"dead_letters"`
	Published               int64   `json:"published"`
}

type outboxReplayDoc struct {
	Matched     []uuid.UUID `json:"matched"`
	Republished int64       `json:"republished"`
	DryRun      bool        `json:"dry_run"`
}

func TestOutbox(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	f.populate(t)

	// A pending command (a saga no engine runs yet), two published relay
	// messages and a dead one.
	e, orderDef, _ := f.engine(t, false)
	_, err := saga.Start(ctx, e, orderDef, order{ID: "o-pending"}, nil)
	require.NoError(t, err)
	published := []uuid.UUID{uuid.New(), uuid.New()}
	for i, id := range published {
		_, err := f.Pool.Exec(ctx, "INSERT INTO "+f.Table("outbox")+
			` (id, topic, aggregateid, type, payload, status, published_at)
			VALUES ($1, 'orders', $2, 'order.created', '\x7b7d', 'published', now() - $3 * interval '1 minute')`,
			id, []string{"o-1", "o-2"}[i], 10-i)
		require.NoError(t, err)
	}
	_, err = f.Pool.Exec(ctx, "INSERT INTO "+f.Table("outbox")+
		` (id, topic, aggregateid, type, payload, status, last_error) VALUES ($1, 'orders', 'o-3', 'order.created', '\x7b7d', 'dead', 'no route')`,
		uuid.New())
	require.NoError(t, err)
	// And two dead letters of a consumer, one of them requeued already.
	_, err = f.Pool.Exec(ctx, "INSERT INTO "+f.Table("dead_letters")+
		` (consumer, topic, reason, requeued_at) VALUES ('payments', 'orders', 'bad', NULL), ('payments', 'orders', 'bad', now())`)
	require.NoError(t, err)

	countStatus := func(status string) int64 {
		return int64(f.Count(t, "SELECT count(*) FROM "+f.Table("outbox")+" WHERE status = $1", status))
	}

	t.Run("status", func(t *testing.T) {
		doc := decode[outboxStatusDoc](t, f.cli(t, "outbox", "status", "--json"))
		require.Equal(t, countStatus("pending"), doc.Pending)
		require.Equal(t, countStatus("dead"), doc.Dead)
		require.Equal(t, countStatus("published"), doc.Published)
		require.Equal(t, int64(1), doc.Pending)
		require.Equal(t, int64(1), doc.Dead)
		require.Equal(t, int64(2), doc.Published)
		require.Equal(t, int64(1), doc.DeadLetters, "the one not requeued")
		require.Greater(t, doc.OldestPendingAgeSeconds, 0.0)

		out := f.cli(t, "outbox", "status").ok(t)
		requireInOrder(t, out, "pending:", "1\n", "oldest pending age:", "dead:", "1\n", "dead letters:", "1\n", "published:", "2\n")
	})

	t.Run("replay dry run", func(t *testing.T) {
		out := f.cli(t, "outbox", "replay", "--dry-run").ok(t)
		requireInOrder(t, out, "dry run: 2 published messages match; nothing was changed",
			published[0].String(), published[1].String()) // oldest first

		doc := decode[outboxReplayDoc](t, f.cli(t, "outbox", "replay", "--dry-run", "--aggregate-id", "o-2", "--json"))
		require.Equal(t, outboxReplayDoc{Matched: []uuid.UUID{published[1]}, DryRun: true}, doc)
		require.Equal(t, int64(2), countStatus("published"))
		require.Equal(t, int64(1), countStatus("pending"))

		// Nothing to do is not an error, and is said in full.
		out = f.cli(t, "outbox", "replay", "--dry-run", "--topic", "no-such-topic").ok(t)
		require.Equal(t, "dry run: no published messages match; nothing would be republished\n", out)
		out = f.cli(t, "outbox", "replay", "--topic", "no-such-topic").ok(t)
		require.Equal(t, "no published messages match; nothing was republished\n", out)
		require.Equal(t, int64(2), countStatus("published"))
	})

	t.Run("bad usage", func(t *testing.T) {
		msg := f.cli(t, "outbox", "replay", "--published-after", "last week").failed(t, exitUsage)
		require.Contains(t, msg, "published-after")
		msg = f.cli(t, "outbox").failed(t, exitUsage)
		require.Contains(t, msg, "missing subcommand")
		msg = f.cli(t, "outbox", "purge").failed(t, exitUsage)
		require.Contains(t, msg, `unknown command "outbox purge"`)
		require.Contains(t, msg, "sagaflow outbox replay")
	})

	t.Run("replay", func(t *testing.T) {
		doc := decode[outboxReplayDoc](t, f.cli(t, "outbox", "replay", "--topic", "orders", "--type", "order.created",
			"--rate", "1000", "--json"))
		require.Equal(t, outboxReplayDoc{Matched: published, Republished: 2}, doc)
		require.Equal(t, int64(0), countStatus("published"))
		require.Equal(t, int64(3), countStatus("pending"))
	})
}
