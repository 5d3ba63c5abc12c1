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
	return newParticipantWith(t, nil)
}

// newParticipantWith is newParticipantOnly with reserve, when not nil, as
// the handler of "reserve" commands.
func newParticipantWith(t *testing.T, reserve func(s *service) func(context.Context, pgx.Tx, participant.Call[reserveCmd]) (struct{}, error)) *participantOnly {
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
	if reserve != nil {
		require.NoError(t, participant.Handle(p, "reserve", reserve(s)))
	} else {
		require.NoError(t, participant.Handle(p, "reserve", move("reserve")))
	}
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

// TestStepsInOneTransactionUndoOnlyTheirOwnWrites: a consumer that takes
// several commands in one transaction gives each step a savepoint of its
// own. A refused step, before or after one that ran, undoes its own key and
// writes only: the step that ran keeps its effect and its reply, and the
// refused one runs when its command comes again.
func TestStepsInOneTransactionUndoOnlyTheirOwnWrites(t *testing.T) {
	t.Parallel()
	po := newParticipantOnly(t)
	ctx := context.Background()
	type cmd struct {
		key     steps.Key
		orderID string
	}
	ok1 := cmd{steps.Key{SagaID: uuid.New(), Step: "reserve", Direction: steps.Forward}, "o-1"}
	bad := cmd{steps.Key{SagaID: uuid.New(), Step: "reserve", Direction: steps.Forward}, "panic"}
	ok2 := cmd{steps.Key{SagaID: uuid.New(), Step: "reserve", Direction: steps.Forward}, "o-2"}
	require.NoError(t, pgx.BeginFunc(ctx, po.pool, func(tx pgx.Tx) error {
		for _, c := range []cmd{ok1, bad, ok2} {
			msg := inbox.Message{ID: uuid.NewString(), Type: "reserve", Value: []byte(`{"order_id":"` + c.orderID + `"}`),
				Headers: map[string]string{store.HeaderStepKey: c.key.String(), store.HeaderReplyTo: "orders.replies"}}
			fresh, err := po.p.Inbox().ProcessTx(ctx, tx, msg, po.p.Handlers()["reserve"])
			require.NoError(t, err)
			require.True(t, fresh)
		}
		return nil
	}))
	require.Equal(t, 2, po.count(t, "SELECT count(*) FROM "+po.table("moves")), "the two steps that ran kept their effects")
	for _, c := range []cmd{ok1, ok2} {
		replies := po.replies(t, c.key)
		require.Len(t, replies, 1)
		require.JSONEq(t, `{"ok":true,"result":{}}`, replies[0])
	}
	replies := po.replies(t, bad.key)
	require.Len(t, replies, 1)
	require.Contains(t, replies[0], `"code":"panic"`)

	// The refused step's key was undone with it: sent again (its cause
	// fixed), it runs.
	po.deliver(t, "reserve", bad.key, "fixed")
	require.Equal(t, 3, po.count(t, "SELECT count(*) FROM "+po.table("moves")))
	replies = po.replies(t, bad.key)
	require.Len(t, replies, 2)
	require.JSONEq(t, `{"ok":true,"result":{}}`, replies[1])
}

// TestAHandlerCannotEndItsTransaction: the transaction a handler is given
// records the step; a handler that tries to commit or roll it back gets an
// error and the step goes on as if it had not tried.
func TestAHandlerCannotEndItsTransaction(t *testing.T) {
	t.Parallel()
	var commitErr, rollbackErr error
	po := newParticipantWith(t, func(s *service) func(context.Context, pgx.Tx, participant.Call[reserveCmd]) (struct{}, error) {
		return func(ctx context.Context, tx pgx.Tx, c participant.Call[reserveCmd]) (struct{}, error) {
			if _, err := tx.Exec(ctx, "INSERT INTO "+s.table("moves")+" VALUES ('reserve')"); err != nil {
				return struct{}{}, err
			}
			commitErr, rollbackErr = tx.Commit(ctx), tx.Rollback(ctx)
			return struct{}{}, nil
		}
	})
	key := steps.Key{SagaID: uuid.New(), Step: "reserve", Direction: steps.Forward}
	po.deliver(t, "reserve", key, "o-1")
	require.ErrorContains(t, commitErr, "may not commit or roll back")
	require.ErrorContains(t, rollbackErr, "may not commit or roll back")
	require.Equal(t, 1, po.count(t, "SELECT count(*) FROM "+po.table("moves")))
	require.Len(t, po.replies(t, key), 1)
	po.deliver(t, "reserve", key, "o-1")
	require.Equal(t, 1, po.count(t, "SELECT count(*) FROM "+po.table("moves")), "the step is recorded: it ran once")
}
