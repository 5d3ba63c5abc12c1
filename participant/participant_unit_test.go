package participant_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/steps"
)

// participantOnly is a participant driven directly, without Kafka: each
// command is handed to its handler through the participant's inbox.
type participantOnly struct {
	*service
	p *participant.Participant
}

func newParticipantOnly(t *testing.T) *participantOnly {
	t.Helper()
	ctx := context.Background()
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(ctx, pool, schema)
	require.NoError(t, err)
	s := &service{pool: pool, schema: schema}
	_, err = pool.Exec(ctx, "CREATE TABLE "+s.table("moves")+" (move text)")
	require.NoError(t, err)
	p, err := participant.New(pool, &participant.Config{Consumer: "inventory", Schema: schema, Logger: quiet,
		ReplyTopics: []string{"orders.replies"}})
	require.NoError(t, err)
	move := func(kind string) func(ctx context.Context, tx pgx.Tx, c participant.Call[reserveCmd]) (struct{}, error) {
		return func(ctx context.Context, tx pgx.Tx, c participant.Call[reserveCmd]) (struct{}, error) {
			if c.Command.OrderID == "panic" {
				panic("a bug in the handler")
			}
			_, err := tx.Exec(ctx, "INSERT INTO "+s.table("moves")+" VALUES ($1)", kind)
			return struct{}{}, err
		}
	}
	require.NoError(t, participant.Handle(p, "reserve", move("reserve")))
	require.NoError(t, participant.Handle(p, "release", move("release")))
	return &participantOnly{service: s, p: p}
}

// deliver hands one command message to the participant, as its consumer
// would: a new message id each time, the step key in a header.
func (po *participantOnly) deliver(t *testing.T, typ string, key steps.Key, orderID string) {
	t.Helper()
	msg := inbox.Message{ID: uuid.NewString(), Type: typ, Value: []byte(`{"order_id":"` + orderID + `"}`),
		Headers: map[string]string{store.HeaderStepKey: key.String(), store.HeaderReplyTo: "orders.replies"}}
	_, err := po.p.Inbox().Process(context.Background(), msg, po.p.Handlers()[typ])
	require.NoError(t, err)
}

func (po *participantOnly) replies(t *testing.T, key steps.Key) []string {
	t.Helper()
	rows, err := po.pool.Query(context.Background(), "SELECT convert_from(payload, 'UTF8') FROM "+po.table("outbox")+
		" WHERE step_key = $1 AND type = $2 ORDER BY created_at", key.String(), steps.ReplyType)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}

// TestCompensationBeforeItsForwardRefusesTheForward: the forward step's
// effect never runs after its compensation, and the forward is answered
// with a refusal (so a saga waiting on it compensates at once rather than
// at its timeout), when the compensation runs and again when the forward
// command arrives.
func TestCompensationBeforeItsForwardRefusesTheForward(t *testing.T) {
	t.Parallel()
	po := newParticipantOnly(t)
	id := uuid.New()
	fwd := steps.Key{SagaID: id, Step: "reserve", Direction: steps.Forward}
	comp := steps.Key{SagaID: id, Step: "reserve", Direction: steps.Compensate}
	// The saga timed out and compensated; the relay delivered the
	// compensation before the (retried) forward command.
	po.deliver(t, "release", comp, "o-1")
	refusal := `{"ok":false,"code":"compensated_before_run","error":"the step's compensation ran before its command arrived; the step was not run"}`
	replies := po.replies(t, fwd)
	require.Len(t, replies, 1, "the forward is refused as soon as the compensation ran")
	require.JSONEq(t, refusal, replies[0])
	po.deliver(t, "reserve", fwd, "o-1")
	require.Equal(t, 1, po.count(t, "SELECT count(*) FROM "+po.table("moves")+" WHERE move = 'release'"))
	require.Equal(t, 0, po.count(t, "SELECT count(*) FROM "+po.table("moves")+" WHERE move = 'reserve'"),
		"the late forward did not reserve what was already released")
	replies = po.replies(t, fwd)
	require.Len(t, replies, 2, "the late forward got the refusal again")
	require.JSONEq(t, refusal, replies[1])
	require.Len(t, po.replies(t, comp), 1)
	require.JSONEq(t, `{"ok":true,"result":{}}`, po.replies(t, comp)[0])
}

// TestCompensationAfterItsForwardRefusesNothing: a forward that ran is
// compensated with no refusal of it.
func TestCompensationAfterItsForwardRefusesNothing(t *testing.T) {
	t.Parallel()
	po := newParticipantOnly(t)
	id := uuid.New()
	fwd := steps.Key{SagaID: id, Step: "reserve", Direction: steps.Forward}
	comp := steps.Key{SagaID: id, Step: "reserve", Direction: steps.Compensate}
	po.deliver(t, "reserve", fwd, "o-1")
	po.deliver(t, "release", comp, "o-1")
	require.Equal(t, 2, po.count(t, "SELECT count(*) FROM "+po.table("moves")))
	replies := po.replies(t, fwd)
	require.Len(t, replies, 1)
	require.JSONEq(t, `{"ok":true,"result":{}}`, replies[0])
}

func TestDuplicateStepSendsItsReplyAgain(t *testing.T) {
	t.Parallel()
	po := newParticipantOnly(t)
	key := steps.Key{SagaID: uuid.New(), Step: "reserve", Direction: steps.Forward}
	po.deliver(t, "reserve", key, "o-2")
	po.deliver(t, "reserve", key, "o-2") // the saga missed the first reply and was resumed
	require.Equal(t, 1, po.count(t, "SELECT count(*) FROM "+po.table("moves")), "the step ran once")
	replies := po.replies(t, key)
	require.Len(t, replies, 2, "its reply was sent again")
	require.Equal(t, replies[0], replies[1])
	require.JSONEq(t, `{"ok":true,"result":{}}`, replies[0])
}

func TestPanickingHandlerRefusesInsteadOfCrashing(t *testing.T) {
	t.Parallel()
	po := newParticipantOnly(t)
	key := steps.Key{SagaID: uuid.New(), Step: "reserve", Direction: steps.Forward}
	po.deliver(t, "reserve", key, "panic")
	replies := po.replies(t, key)
	require.Len(t, replies, 1)
	require.Contains(t, replies[0], `"ok":false`)
	require.Contains(t, replies[0], `"code":"panic"`)
	require.Contains(t, replies[0], "a bug in the handler")
}
