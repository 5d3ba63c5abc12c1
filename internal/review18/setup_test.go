// Package review18 is a black-box review, written from the documentation
// only, of three changes of issue #17 (CHANGELOG "Changed", first three
// bullets): a per-message saga read on its key; a batch of Kafka messages
// (Kafka mode's steps, the hybrid mode's replies) that reads and locks the
// sagas of all its messages in one round trip before any runs, unless two
// messages name one saga; and participant handlers that get the consumer's
// transaction, whose Commit and Rollback fail, each step under a savepoint
// opened with its step key and never released. See FINDINGS.md.
package review18

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// TestMain runs four tests at once unless -parallel says otherwise: the
// tests mostly wait on PostgreSQL, the broker and the engines' polls, not on
// the CPU (copied from internal/review11).
func TestMain(m *testing.M) { pgtest.MainParallel(m, 4) }

// wait bounds every poll of a test.
const wait = 30 * time.Second

// ord is the sagas' state.
type ord struct {
	ID   string `json:"id"`
	Paid string `json:"paid,omitempty"`
}

// opCtx bounds an operator's call: an operator that waits for a batch to
// end would hold the test up forever (the batch waits for the test's gate).
func opCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func noBackoff(n int) *saga.RetryPolicy {
	return &saga.RetryPolicy{MaxAttempts: n, Backoff: func(int) time.Duration { return 10 * time.Millisecond }}
}

func get(t *testing.T, e *saga.Engine, id uuid.UUID) *saga.Instance {
	t.Helper()
	in, err := e.Get(context.Background(), id)
	require.NoError(t, err)
	return in
}

func timeline(in *saga.Instance) []string { return testkit.Timeline(in) }

// replyRow is one reply a participant wrote to its outbox.
type replyRow struct {
	topic string
	steps.Reply
}

// replies lists the replies d's outbox holds for step key key, oldest first.
func replies(t *testing.T, d *testkit.DB, key string) []replyRow {
	t.Helper()
	rows, err := d.Pool.Query(context.Background(), "SELECT topic, payload FROM "+d.Table("outbox")+
		" WHERE step_key = $1 AND type = $2 ORDER BY created_at, ctid", key, steps.ReplyType)
	require.NoError(t, err)
	var out []replyRow
	var topic string
	var payload []byte
	_, err = pgx.ForEachRow(rows, []any{&topic, &payload}, func() error {
		var r steps.Reply
		if err := json.Unmarshal(payload, &r); err != nil {
			return err
		}
		out = append(out, replyRow{topic: topic, Reply: r})
		return nil
	})
	require.NoError(t, err)
	return out
}

// logBatched logs how many messages ran several to a transaction. It is
// not asserted: whether a kafka-go reader holds a backlog ready at once when
// the consumer looks is the broker's and the scheduler's timing (the
// several-to-a-transaction promises are also tested without Kafka, with
// Inbox.ProcessTx). Every run of this review saw batches except where
// FINDINGS.md says.
func logBatched(t *testing.T, what string, n int64) {
	t.Helper()
	if n == 0 {
		t.Logf("no %s ran several to a transaction in this run", what)
		return
	}
	t.Logf("%d %s ran several to a transaction", n, what)
}
