package saga

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
)

// DeadKind names one of the two places where messages that could not be
// handled are parked.
type DeadKind string

const (
	// DeadOutbox: outbox rows parked as dead, messages sagaflow could not
	// send (the relay refused or gave up on them, or the engine parked a
	// command).
	DeadOutbox DeadKind = "outbox"
	// DeadLetters: messages a consumer received and could not process
	// (the dead_letters table).
	DeadLetters DeadKind = "letters"
)

// Limits of [Engine.RequeueDead].
const (
	// RequeueMaxDefault caps a requeue by filter that sets no Max.
	RequeueMaxDefault = 100
	// RequeueMaxLimit is the largest Max, and the most ids, a requeue
	// accepts.
	RequeueMaxLimit = 10000
)

// DeadOpts filters [Engine.DeadMessages] and [Engine.DeadLetters]. Zero
// fields do not filter.
type DeadOpts struct {
	// Consumer selects the dead letters of one consumer; outbox rows have
	// none, so DeadMessages refuses it.
	Consumer string
	Topic    string
	// Since selects what was parked at or after it.
	Since time.Time
	// IncludeRequeued lists dead letters that were requeued already too.
	IncludeRequeued bool
	// Cursor continues a previous listing: pass its NextCursor.
	Cursor string
	// Limit is the page size. Defaults to ListLimitDefault; at most
	// ListLimitMax.
	Limit int
}

func (o *DeadOpts) filter(op string) (store.DeadFilter, error) {
	var c DeadOpts
	if o != nil {
		c = *o
	}
	switch {
	case c.Limit < 0 || c.Limit > ListLimitMax:
		return store.DeadFilter{}, fmt.Errorf("saga: %s: Limit %d is outside 0..%d", op, c.Limit, ListLimitMax)
	case c.Limit == 0:
		c.Limit = ListLimitDefault
	}
	if err := checkInput(op, inputField{"DeadOpts.Consumer", c.Consumer, 0}, inputField{"DeadOpts.Topic", c.Topic, 0},
		inputField{"DeadOpts.Cursor", c.Cursor, 0}); err != nil {
		return store.DeadFilter{}, err
	}
	return store.DeadFilter{Consumer: c.Consumer, Topic: c.Topic, Since: c.Since, IncludeRequeued: c.IncludeRequeued,
		Cursor: c.Cursor, Limit: c.Limit}, nil
}

// DeadMessage is an outbox row parked as dead.
type DeadMessage struct {
	ID            uuid.UUID
	Topic         string
	Delivery      string // "relay" (to a broker) or "direct" (a Postgres-only command)
	AggregateType string
	AggregateID   string // the partition key
	Type          string
	SagaID        *uuid.UUID
	StepKey       *string
	Attempts      int
	// LastError is why it was parked; the relay's reasons start with a
	// stable code (relay.CodeTooLarge, …).
	LastError    string
	PayloadBytes int
	CreatedAt    time.Time
}

// DeadMessagePage is one page of dead outbox rows, oldest first.
type DeadMessagePage struct {
	Messages   []DeadMessage
	NextCursor string // "" on the last page
}

// DeadMessages lists outbox rows parked as dead, oldest first, one page at
// a time.
func (e *Engine) DeadMessages(ctx context.Context, opts *DeadOpts) (*DeadMessagePage, error) {
	f, err := opts.filter("dead messages")
	if err != nil {
		return nil, err
	}
	if f.Consumer != "" {
		return nil, fmt.Errorf("saga: dead messages: outbox rows have no consumer (Consumer %q filters dead letters)", f.Consumer)
	}
	rows, next, err := e.st.DeadMessages(ctx, e.pool, f)
	if err != nil {
		return nil, err
	}
	page := &DeadMessagePage{NextCursor: next, Messages: make([]DeadMessage, len(rows))}
	for i, r := range rows {
		page.Messages[i] = DeadMessage(r)
	}
	return page, nil
}

// DeadLetter is a message a consumer could not process.
type DeadLetter struct {
	ID        int64
	Consumer  string
	MessageID string // "" when the message had none
	Topic     string
	Partition *int
	Offset    *int64
	Key       []byte
	// ValueBytes is the size of the message's value.
	ValueBytes int
	// Headers is a storable rendering of the message's headers (the raw
	// bytes are kept too, and are what a requeue sends).
	Headers    map[string]string
	Reason     string
	CreatedAt  time.Time
	RequeuedAt *time.Time // nil until requeued
}

// DeadLetterPage is one page of dead letters, oldest first.
type DeadLetterPage struct {
	Letters    []DeadLetter
	NextCursor string // "" on the last page
}

// DeadLetters lists the messages consumers dead-lettered, oldest first,
// one page at a time; requeued ones only with IncludeRequeued.
func (e *Engine) DeadLetters(ctx context.Context, opts *DeadOpts) (*DeadLetterPage, error) {
	f, err := opts.filter("dead letters")
	if err != nil {
		return nil, err
	}
	rows, next, err := e.st.DeadLetters(ctx, e.pool, f)
	if err != nil {
		return nil, err
	}
	page := &DeadLetterPage{NextCursor: next, Letters: make([]DeadLetter, len(rows))}
	for i, r := range rows {
		page.Letters[i] = DeadLetter(r)
	}
	return page, nil
}

// RequeueOpts selects what [Engine.RequeueDead] puts back: either ids, of
// either kind, or with All every item of one Kind that matches the filter,
// oldest first, at most Max.
type RequeueOpts struct {
	// MessageIDs are dead outbox rows.
	MessageIDs []uuid.UUID
	// LetterIDs are dead letters.
	LetterIDs []int64

	// All selects by filter instead of by id.
	All bool
	// Kind is what All selects. Defaults to DeadLetters when Consumer is
	// set; required otherwise.
	Kind DeadKind
	// Consumer (dead letters only), Topic and Since filter what All
	// selects.
	Consumer string
	Topic    string
	Since    time.Time
	// Max caps what All selects. Defaults to RequeueMaxDefault; at most
	// RequeueMaxLimit.
	Max int

	// DryRun does everything in a transaction that is rolled back, and
	// reports what would have been requeued and what would have failed.
	DryRun bool
	// Reason is recorded, with who asked when the caller says so ("by
	// anna: provider fixed"), in the history of each saga whose command is
	// requeued ([EventCommandRequeued]). Defaults to "requeued".
	Reason string
}

// EventCommandRequeued: an operator requeued a parked command of the saga
// ([Engine.RequeueDead]); the detail has its message id, topic and reason.
const EventCommandRequeued = "command_requeued"

// RequeueResult reports [Engine.RequeueDead].
type RequeueResult struct {
	// Messages are the dead outbox rows made pending again.
	Messages []uuid.UUID
	// Letters are the dead letters sent again.
	Letters []RequeuedLetter
	// Failed lists what could not be requeued, and why; the rest went on.
	Failed []RequeueFailure
	DryRun bool
}

// RequeuedLetter is a dead letter sent again.
type RequeuedLetter struct {
	ID       int64
	Consumer string
	Topic    string
	// OutboxID is the outbox row that publishes it again.
	OutboxID uuid.UUID
	// MessageID is the message id it carries: its original one, so that
	// consumers that processed it skip it. "" when it has none.
	MessageID string
}

// RequeueFailure is an item [Engine.RequeueDead] could not requeue.
type RequeueFailure struct {
	Kind DeadKind
	ID   string // the outbox row's uuid or the dead letter's number
	Err  error
}

// RequeueDead puts dead items back:
//
//   - A dead outbox row becomes pending again, due now, with its attempts
//     reset; its last_error keeps why it was parked, after "requeued; was: ".
//   - A dead letter is published again to its topic through the outbox (a
//     new relay row) with the key, value and headers it was received with,
//     so it keeps its original message id and every consumer that
//     processed it skips it; the inbox key of the consumer that
//     dead-lettered it is deleted, and its requeued_at set, in the same
//     transaction. Run a relay for it to be published.
//
// An item that cannot be requeued (gone, not dead, requeued already, or a
// dead letter whose key the outbox cannot hold) is reported in
// RequeueResult.Failed and the rest go on. A database error stops the
// requeue and is returned with what was done so far.
func (e *Engine) RequeueDead(ctx context.Context, opts *RequeueOpts) (*RequeueResult, error) {
	var o RequeueOpts
	if opts != nil {
		o = *opts
	}
	if err := o.normalise(); err != nil {
		return nil, err
	}
	res := &RequeueResult{DryRun: o.DryRun}
	messages, letters := o.MessageIDs, o.LetterIDs
	if o.All {
		var err error
		if messages, letters, err = e.selectDead(ctx, &o); err != nil {
			return nil, err
		}
	}
	if err := e.requeueMessages(ctx, messages, o.DryRun, o.Reason, res); err != nil {
		return res, err
	}
	for _, id := range letters {
		if err := e.requeueLetter(ctx, id, o.DryRun, o.Reason, res); err != nil {
			return res, err
		}
	}
	return res, nil
}

func (o *RequeueOpts) normalise() error {
	ids := len(o.MessageIDs) + len(o.LetterIDs)
	switch {
	case o.All && ids > 0:
		return errors.New("saga: requeue dead: give ids or All, not both")
	case !o.All && ids == 0:
		return errors.New("saga: requeue dead: nothing selected: give ids or All")
	case ids > RequeueMaxLimit:
		return fmt.Errorf("saga: requeue dead: %d ids, more than %d", ids, RequeueMaxLimit)
	case o.Max < 0 || o.Max > RequeueMaxLimit:
		return fmt.Errorf("saga: requeue dead: Max %d is outside 0..%d", o.Max, RequeueMaxLimit)
	case !o.All && (o.Kind != "" || o.Consumer != "" || o.Topic != "" || !o.Since.IsZero() || o.Max != 0):
		return errors.New("saga: requeue dead: Kind, Consumer, Topic, Since and Max select with All only")
	}
	if !o.All {
		return nil
	}
	if o.Kind == "" && o.Consumer != "" {
		o.Kind = DeadLetters
	}
	switch o.Kind {
	case DeadLetters:
	case DeadOutbox:
		if o.Consumer != "" {
			return fmt.Errorf("saga: requeue dead: outbox rows have no consumer (Consumer %q selects dead letters)", o.Consumer)
		}
	case "":
		return fmt.Errorf("saga: requeue dead: All needs a Kind (%s or %s)", DeadOutbox, DeadLetters)
	default:
		return fmt.Errorf("saga: requeue dead: unknown Kind %q (want %s or %s)", o.Kind, DeadOutbox, DeadLetters)
	}
	if o.Max == 0 {
		o.Max = RequeueMaxDefault
	}
	return nil
}

// selectDead picks, oldest first, what a requeue with All puts back.
func (e *Engine) selectDead(ctx context.Context, o *RequeueOpts) ([]uuid.UUID, []int64, error) {
	f := store.DeadFilter{Consumer: o.Consumer, Topic: o.Topic, Since: o.Since, Limit: o.Max}
	if o.Kind == DeadOutbox {
		rows, _, err := e.st.DeadMessages(ctx, e.pool, f)
		if err != nil {
			return nil, nil, fmt.Errorf("saga: requeue dead: %w", err)
		}
		ids := make([]uuid.UUID, len(rows))
		for i, r := range rows {
			ids[i] = r.ID
		}
		return ids, nil, nil
	}
	rows, _, err := e.st.DeadLetters(ctx, e.pool, f)
	if err != nil {
		return nil, nil, fmt.Errorf("saga: requeue dead: %w", err)
	}
	ids := make([]int64, len(rows))
	for i, r := range rows {
		ids[i] = r.ID
	}
	return nil, ids, nil
}

// errDryRun rolls back a dry run's transaction.
var errDryRun = errors.New("dry run")

func (e *Engine) requeueMessages(ctx context.Context, ids []uuid.UUID, dryRun bool, reason string, res *RequeueResult) error {
	if len(ids) == 0 {
		return nil
	}
	var done []uuid.UUID
	var why map[uuid.UUID]string
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		var err error
		if done, why, err = e.st.RequeueDeadMessages(ctx, tx, ids); err != nil {
			return err
		}
		if err := e.st.RecordRequeued(ctx, tx, done, EventCommandRequeued, requeueReason(reason)); err != nil {
			return err
		}
		if dryRun {
			return errDryRun
		}
		return nil
	})
	if err != nil && !errors.Is(err, errDryRun) {
		return fmt.Errorf("saga: requeue dead: %w", err)
	}
	requeued := make(map[uuid.UUID]bool, len(done))
	for _, id := range done {
		requeued[id] = true
	}
	for _, id := range ids {
		if reason, ok := why[id]; ok {
			res.Failed = append(res.Failed, RequeueFailure{Kind: DeadOutbox, ID: id.String(),
				Err: fmt.Errorf("saga: outbox message %s cannot be requeued: %s", id, reason)})
			delete(why, id) // once per id
		} else if requeued[id] {
			res.Messages = append(res.Messages, id)
			delete(requeued, id) // once per id
		}
	}
	return nil
}

func (e *Engine) requeueLetter(ctx context.Context, id int64, dryRun bool, reason string, res *RequeueResult) error {
	var done *store.RequeuedLetter
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		var err error
		if done, err = e.st.RequeueDeadLetter(ctx, tx, id, uuid.Must(uuid.NewV7())); err != nil {
			return err
		}
		if err := e.st.RecordRequeued(ctx, tx, []uuid.UUID{done.OutboxID}, EventCommandRequeued, requeueReason(reason)); err != nil {
			return err
		}
		if dryRun {
			return errDryRun
		}
		return nil
	})
	switch {
	case errors.Is(err, store.ErrNotRequeueable):
		res.Failed = append(res.Failed, RequeueFailure{Kind: DeadLetters, ID: strconv.FormatInt(id, 10), Err: err})
		return nil
	case err != nil && !errors.Is(err, errDryRun):
		return fmt.Errorf("saga: requeue dead: %w", err)
	}
	res.Letters = append(res.Letters, RequeuedLetter(*done))
	return nil
}

// requeueReason is the stored reason of a requeue.
func requeueReason(reason string) string {
	reason = safetext.Text(strings.TrimSpace(reason), MaxReasonBytes)
	if reason == "" {
		return "requeued"
	}
	return reason
}
