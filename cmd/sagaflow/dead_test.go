package main

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
)

type deadListDoc struct {
	Messages []struct {
		ID        uuid.UUID `json:"id"`
		Topic     string    `json:"topic"`
		LastError string    `json:"last_error"`
		Attempts  int       `json:"attempts"`
	} `json:"messages"`
	MessagesNextCursor string `json:"messages_next_cursor"`
	Letters            []struct {
		ID       int64  `json:"id"`
		Consumer string `json:"consumer"`
		Key      []byte `json:"key"`
		Reason   string `json:"reason"`
	} `json:"letters"`
}

type deadRequeueDoc struct {
	Messages []uuid.UUID `json:"messages"`
	Letters  []struct {
		ID        int64     `json:"id"`
		Consumer  string    `json:"consumer"`
		OutboxID  uuid.UUID `json:"outbox_id"`
		MessageID string    `json:"message_id"`
	} `json:"letters"`
	Failed []struct {
		Kind  string `json:"kind"`
		ID    string `json:"id"`
		Error string `json:"error"`
	} `json:"failed"`
	DryRun bool `json:"dry_run"`
}

func TestDead(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	st, err := store.New(f.Schema)
	require.NoError(t, err)

	// Two dead outbox messages, the first with a reason that would drive
	// a terminal; three dead letters, one with a key the outbox cannot hold.
	var messages []uuid.UUID
	for i, reason := range []string{"message_too_large: \x1b[2J\x1b]0;owned\x07", "invalid_topic: no"} {
		m := &store.Message{ID: uuid.Must(uuid.NewV7()), Topic: []string{"orders", "payments"}[i], AggregateID: "k",
			Type: "t", Payload: []byte("p")}
		require.NoError(t, st.InsertMessage(ctx, f.Pool, m))
		require.NoError(t, st.MarkFailed(ctx, f.Pool, []store.RelayFailure{{ID: m.ID, Err: reason, Dead: true}}))
		messages = append(messages, m.ID)
	}
	var letters []int64
	for i, key := range [][]byte{[]byte("a"), []byte("b\r\x1b[1A"), {0xff}} {
		p, o := 0, int64(i)
		require.NoError(t, st.InsertDeadLetter(ctx, f.Pool, &store.DeadLetter{Consumer: "billing\x1b[31m",
			MessageID: uuid.NewString(), Topic: "orders", Partition: &p, Offset: &o, Key: key, Value: []byte("v"),
			Reason: "refused\nby handler"}))
		var id int64
		require.NoError(t, f.Pool.QueryRow(ctx, "SELECT max(id) FROM "+f.Table("dead_letters")).Scan(&id))
		letters = append(letters, id)
	}
	lid := func(i int) string { return strconv.FormatInt(letters[i], 10) }
	countDead := func() (outbox, letters int) {
		return f.Count(t, "SELECT count(*) FROM "+f.Table("outbox")+" WHERE status = 'dead'"),
			f.Count(t, "SELECT count(*) FROM "+f.Table("dead_letters")+" WHERE requeued_at IS NULL")
	}

	t.Run("list", func(t *testing.T) {
		out := f.cli(t, "dead", "list").ok(t)
		requireInOrder(t, out, "DEAD OUTBOX MESSAGES", messages[0].String(), `message_too_large: \u001b[2J\u001b]0;owned\u0007`,
			messages[1].String(), "DEAD LETTERS", lid(0), `billing\u001b[31m`, "0/0", `refused\nby handler`,
			lid(1), `b\r\u001b[1A`, lid(2), `\xff`)
		require.NotContains(t, out, "\x1b", "stored text is escaped")
		require.NotContains(t, out, "\r")

		doc := decode[deadListDoc](t, f.cli(t, "dead", "list", "--kind", "outbox", "--limit", "1", "--json"))
		require.Len(t, doc.Messages, 1)
		require.Empty(t, doc.Letters)
		require.Equal(t, messages[0], doc.Messages[0].ID)
		require.NotEmpty(t, doc.MessagesNextCursor)
		doc = decode[deadListDoc](t, f.cli(t, "dead", "list", "--kind", "outbox", "--cursor", doc.MessagesNextCursor, "--json"))
		require.Len(t, doc.Messages, 1)
		require.Equal(t, messages[1], doc.Messages[0].ID)

		out = f.cli(t, "dead", "list", "--kind", "letters", "--limit", "2").ok(t)
		requireInOrder(t, out, lid(0), lid(1), "next page: --kind letters --cursor ")
		require.NotContains(t, out, "DEAD LETTERS", "no heading for one kind")

		doc = decode[deadListDoc](t, f.cli(t, "dead", "list", "--consumer", "billing\x1b[31m", "--json"))
		require.Empty(t, doc.Messages, "--consumer selects dead letters")
		require.Len(t, doc.Letters, 3)
		require.Equal(t, []byte{0xff}, doc.Letters[2].Key)

		require.Contains(t, f.cli(t, "dead", "list", "--topic", "nowhere").ok(t), "no dead letters match")
	})

	t.Run("requeue dry run", func(t *testing.T) {
		doc := decode[deadRequeueDoc](t, f.cli(t, "dead", "requeue", "--id", messages[0].String(),
			"--id", lid(0)+","+lid(2), "--dry-run", "--json"))
		require.True(t, doc.DryRun)
		require.Equal(t, []uuid.UUID{messages[0]}, doc.Messages)
		require.Len(t, doc.Letters, 1)
		require.Len(t, doc.Failed, 1)
		o, l := countDead()
		require.Equal(t, 2, o, "nothing changed")
		require.Equal(t, 3, l)
		out := f.cli(t, "dead", "requeue", "--id", lid(2), "--dry-run").ok(t)
		requireInOrder(t, out, "dry run: 0 would be requeued, 1 would fail; nothing was changed",
			"failed", "letter "+lid(2), "cannot be requeued: its key is not valid UTF-8")
	})

	t.Run("requeue", func(t *testing.T) {
		r := f.cli(t, "dead", "requeue", "--id", messages[0].String(), "--id", lid(0)+","+lid(2))
		require.Equal(t, exitFailed, r.code, "one could not be requeued: %s", r.stdout)
		require.Empty(t, r.stderr)
		requireInOrder(t, r.stdout, "requeued 2, failed 1", "outbox", messages[0].String(), "pending again",
			"letter", lid(0), "sent again as outbox message", "failed", "letter "+lid(2), "its key is not valid UTF-8")
		o, l := countDead()
		require.Equal(t, 1, o)
		require.Equal(t, 2, l)
		require.Equal(t, 2, f.Count(t, "SELECT count(*) FROM "+f.Table("outbox")+" WHERE status = 'pending'"),
			"the requeued message, and the row that sends the dead letter again")

		doc := decode[deadRequeueDoc](t, f.cli(t, "dead", "requeue", "--all", "--kind", "outbox", "--max", "5", "--json"))
		require.Equal(t, []uuid.UUID{messages[1]}, doc.Messages)
		require.Empty(t, doc.Failed)
		doc = decode[deadRequeueDoc](t, f.cli(t, "dead", "requeue", "--all", "--consumer", "billing\x1b[31m", "--max", "1", "--json"))
		require.Len(t, doc.Letters, 1)
		require.Equal(t, letters[1], doc.Letters[0].ID, "the oldest not requeued")
		o, l = countDead()
		require.Zero(t, o)
		require.Equal(t, 1, l, "only the one that cannot be requeued")
	})

	t.Run("bad usage", func(t *testing.T) {
		for args, want := range map[string]string{
			"dead":              "missing subcommand",
			"dead purge":        `unknown subcommand "purge"`,
			"dead list --max 3": "--max do not apply",
			"dead requeue --limit 3 --all --kind outbox": "--limit do not apply",
			"dead requeue":                              "give --id or --all",
			"dead requeue --all":                        "give --kind",
			"dead requeue --all --id 1":                 "give --id or --all",
			"dead requeue --id 1 --topic orders":        "--topic select with --all only",
			"dead requeue --id nope":                    `"nope" is neither an outbox message's UUID nor a dead letter's number`,
			"dead list --cursor abc":                    "give --kind too",
			"dead list --kind everything":               `--kind "everything": want outbox or letters`,
			"dead list --kind outbox --consumer c":      "--consumer selects dead letters",
			"dead list extra":                           `unexpected argument "extra"`,
			"dead requeue --all --kind outbox --max -1": "--max -1 is outside",
		} {
			msg := f.cli(t, strings.Fields(args)...).failed(t, exitUsage)
			require.Contains(t, msg, want, args)
		}
		msg := f.cli(t, "dead", "list", "--kind", "outbox", "--cursor", "abc").failed(t, exitUsage)
		require.Contains(t, msg, "malformed cursor")
		require.Contains(t, f.cli(t, "help", "dead").ok(t), "Usage: sagaflow dead list")
	})
}
