package review18

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

// pcmd is a command as the participant's handlers decode it. Mode says how
// the handler behaves (see modes).
type pcmd struct {
	ID   string `json:"id"`
	Mode string `json:"mode"`
}

// A mode is a way for a handler to behave: what it leaves in the table
// "moves" when its step counts, and the reply (ok, or refused with code).
type mode struct {
	moves []string // the rows it keeps, in order, besides nothing on refusal
	ok    bool
	code  string
}

// modes: every handler of the worst user. A refusal keeps no move.
var modes = map[string]mode{
	"ok":           {moves: []string{"do"}, ok: true},
	"refuse":       {code: "no_stock"},
	"panic":        {code: participant.CodePanic},
	"sqlrefuse":    {code: "after_sql_error"},                  // uses tx, a statement fails (tx aborted), then refuses
	"nestcommit":   {moves: []string{"inner", "do"}, ok: true}, // tx.Begin, write, Commit the nested one
	"nestrollback": {moves: []string{"do"}, ok: true},          // write; tx.Begin, write, Rollback the nested one
	"nestrefuse":   {code: "no_stock"},                         // tx.Begin, write, Commit nested, then refuse
	"nestsqlok":    {moves: []string{"do"}, ok: true},          // tx.Begin, failing statement, Rollback nested, write
	"nestleak":     {moves: []string{"inner", "do"}, ok: true}, // tx.Begin, write, never end the nested one
	"nestleakref":  {code: "no_stock"},                         // tx.Begin, write, never end it, refuse
	"endtx":        {moves: []string{"do", "after"}, ok: true}, // write; tx.Commit and tx.Rollback (errors); write
	"endtxrefuse":  {code: "no_stock"},                         // write; tx.Rollback (error); refuse
	"nestpanic":    {code: participant.CodePanic},              // tx.Begin, write, panic with it open
	"sqlpanic":     {code: participant.CodePanic},              // a statement fails (tx aborted), then panic
	"refuseonce":   {moves: []string{"do"}, ok: true},          // refuses its first run only
}

// participantRig is a participant on a schema of its own with handlers
// "r18.do" (forward) and "r18.undo" (its compensation), which record what
// they keep in "moves" (id, move, step_key) and count their runs.
type participantRig struct {
	db      *testkit.DB
	p       *participant.Participant
	replyTo string
	tenant  string

	mu       sync.Mutex
	runs     map[string]int     // handler runs by step key
	endErrs  map[string][]error // tx.Commit / tx.Rollback errors by step key
	sawOther []string           // commands of another tenant's ids
}

func newParticipantRig(t *testing.T, consumer, replyTo, tenant string) *participantRig {
	t.Helper()
	r := &participantRig{db: testkit.NewDB(t), replyTo: replyTo, tenant: tenant, runs: map[string]int{}, endErrs: map[string][]error{}}
	ctx := context.Background()
	_, err := r.db.Pool.Exec(ctx, "CREATE TABLE "+r.db.Table("moves")+" (id text, move text, step_key text); CREATE INDEX ON "+
		r.db.Table("moves")+" (id)")
	require.NoError(t, err)
	r.p, err = participant.New(r.db.Pool, &participant.Config{Consumer: consumer, Schema: r.db.Schema, Logger: testkit.Discard,
		ReplyTopics: []string{replyTo}})
	require.NoError(t, err)
	require.NoError(t, participant.Handle(r.p, "r18.do", r.handler("do")))
	require.NoError(t, participant.Handle(r.p, "r18.undo", r.handler("undo")))
	return r
}

func (r *participantRig) handler(kind string) func(ctx context.Context, tx pgx.Tx, c participant.Call[pcmd]) (map[string]string, error) {
	return func(ctx context.Context, tx pgx.Tx, c participant.Call[pcmd]) (map[string]string, error) {
		r.mu.Lock()
		r.runs[c.Key.String()]++
		n := r.runs[c.Key.String()]
		if r.tenant != "" && !strings.HasPrefix(c.Command.ID, r.tenant) {
			r.sawOther = append(r.sawOther, c.Command.ID)
		}
		r.mu.Unlock()
		move := func(q pgx.Tx, what string) error {
			if kind == "undo" && what == "do" {
				what = "undo"
			}
			_, err := q.Exec(ctx, "INSERT INTO "+r.db.Table("moves")+" VALUES ($1, $2, $3)", c.Command.ID, what, c.Key.String())
			return err
		}
		refuse := func() error { return steps.Permanent(steps.WithCode("no_stock", errors.New("review18: no stock"))) }
		result := map[string]string{"ref": kind + "-" + c.Command.ID}
		switch c.Command.Mode {
		case "", "ok":
			return result, move(tx, "do")
		case "refuse":
			if err := move(tx, "do"); err != nil {
				return nil, err
			}
			return nil, refuse()
		case "panic":
			if err := move(tx, "do"); err != nil {
				return nil, err
			}
			panic("review18: a bug in the handler")
		case "sqlrefuse":
			if err := move(tx, "do"); err != nil {
				return nil, err
			}
			_, err := tx.Exec(ctx, "INSERT INTO "+r.db.Table("no_such_table")+" VALUES (1)")
			if err == nil {
				return nil, errors.New("review18: the failing statement succeeded")
			}
			return nil, steps.Permanent(steps.WithCode("after_sql_error", err))
		case "nestcommit", "nestrefuse":
			sub, err := tx.Begin(ctx)
			if err != nil {
				return nil, err
			}
			if err := move(sub, "inner"); err != nil {
				return nil, err
			}
			if err := sub.Commit(ctx); err != nil {
				return nil, err
			}
			if c.Command.Mode == "nestrefuse" {
				return nil, refuse()
			}
			return result, move(tx, "do")
		case "nestrollback":
			if err := move(tx, "do"); err != nil {
				return nil, err
			}
			sub, err := tx.Begin(ctx)
			if err != nil {
				return nil, err
			}
			if err := move(sub, "inner"); err != nil {
				return nil, err
			}
			return result, sub.Rollback(ctx)
		case "nestsqlok":
			sub, err := tx.Begin(ctx)
			if err != nil {
				return nil, err
			}
			if _, err := sub.Exec(ctx, "INSERT INTO "+r.db.Table("no_such_table")+" VALUES (1)"); err == nil {
				return nil, errors.New("review18: the failing statement succeeded")
			}
			if err := sub.Rollback(ctx); err != nil {
				return nil, err
			}
			return result, move(tx, "do")
		case "nestpanic":
			sub, err := tx.Begin(ctx)
			if err != nil {
				return nil, err
			}
			if err := move(sub, "inner"); err != nil {
				return nil, err
			}
			panic("review18: a bug with a savepoint open")
		case "sqlpanic":
			if err := move(tx, "do"); err != nil {
				return nil, err
			}
			_, _ = tx.Exec(ctx, "INSERT INTO "+r.db.Table("no_such_table")+" VALUES (1)")
			panic("review18: a bug after a failed statement")
		case "nestleak", "nestleakref":
			sub, err := tx.Begin(ctx)
			if err != nil {
				return nil, err
			}
			if err := move(sub, "inner"); err != nil {
				return nil, err
			}
			if c.Command.Mode == "nestleakref" {
				return nil, refuse()
			}
			return result, move(tx, "do")
		case "endtx", "endtxrefuse":
			if err := move(tx, "do"); err != nil {
				return nil, err
			}
			var errs []error
			if c.Command.Mode == "endtx" {
				errs = append(errs, tx.Commit(ctx))
			}
			errs = append(errs, tx.Rollback(ctx))
			r.mu.Lock()
			r.endErrs[c.Key.String()] = append(r.endErrs[c.Key.String()], errs...)
			r.mu.Unlock()
			if c.Command.Mode == "endtxrefuse" {
				return nil, refuse()
			}
			return result, move(tx, "after")
		case "refuseonce":
			if n == 1 {
				if err := move(tx, "do"); err != nil {
					return nil, err
				}
				return nil, refuse()
			}
			return result, move(tx, "do")
		case "flaky": // an error that is not permanent on its first run
			if err := move(tx, "do"); err != nil {
				return nil, err
			}
			if n == 1 {
				return nil, errors.New("review18: the provider timed out")
			}
			return result, nil
		}
		return nil, fmt.Errorf("review18: unknown mode %q", c.Command.Mode)
	}
}

// command is one delivery of a command: its step key, message id and
// payload.
type command struct {
	key   steps.Key
	msgID string
	typ   string
	cmd   pcmd
}

func newCommand(mode string) command {
	id := uuid.New()
	return command{key: steps.Key{SagaID: id, Step: "pay", Direction: steps.Forward}, msgID: uuid.NewString(), typ: "r18.do",
		cmd: pcmd{ID: "o-" + id.String()[:8], Mode: mode}}
}

// again is another delivery of c (a new message id).
func (c command) again() command {
	c.msgID = uuid.NewString()
	return c
}

// compensation is the compensation command of c's step.
func (c command) compensation(mode string) command {
	c.key.Direction = steps.Compensate
	c.msgID = uuid.NewString()
	c.typ = "r18.undo"
	c.cmd.Mode = mode
	return c
}

func (r *participantRig) message(c command) inbox.Message {
	v := []byte(fmt.Sprintf(`{"id":%q,"mode":%q}`, c.cmd.ID, c.cmd.Mode))
	return inbox.Message{ID: c.msgID, Type: c.typ, Key: []byte(c.key.SagaID.String()), Value: v,
		Headers: map[string]string{wire.HeaderMessageID: c.msgID, wire.HeaderType: c.typ, wire.HeaderSagaID: c.key.SagaID.String(),
			wire.HeaderStepKey: c.key.String(), wire.HeaderDirection: string(c.key.Direction), wire.HeaderReplyTo: r.replyTo}}
}

// batch processes cmds in one transaction with Inbox.ProcessTx, as a
// consumer with BatchSize > 1 does, and commits. It returns what ProcessTx
// reported for each (false: a duplicate message id).
func (r *participantRig) batch(t *testing.T, cmds ...command) []bool {
	t.Helper()
	ctx := context.Background()
	fresh := make([]bool, len(cmds))
	tx, err := r.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	for i, c := range cmds {
		fresh[i], err = r.p.Inbox().ProcessTx(ctx, tx, r.message(c), r.p.Handlers()[c.typ])
		require.NoError(t, err, "command %d (%s, %s)", i, c.cmd.Mode, c.key)
	}
	require.NoError(t, tx.Commit(ctx), "the batch's transaction commits")
	return fresh
}

func (r *participantRig) moves(t *testing.T, id string) []string {
	t.Helper()
	rows, err := r.db.Pool.Query(context.Background(), "SELECT move FROM "+r.db.Table("moves")+" WHERE id = $1 ORDER BY ctid", id)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}

func (r *participantRig) runsOf(k steps.Key) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.runs[k.String()]
}

// replyShape is a reply as "ok" or "refused:<code>".
func replyShape(rs []replyRow) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		if r.OK {
			out[i] = "ok"
		} else {
			out[i] = "refused:" + r.Code
		}
	}
	return out
}

func sorted(s []string) []string {
	s = append([]string(nil), s...)
	sort.Strings(s)
	return s
}

func (m mode) reply() string {
	if m.ok {
		return "ok"
	}
	return "refused:" + m.code
}
