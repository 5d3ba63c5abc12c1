package main

import (
	"context"
	"flag"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/saga"
)

// The dead command: `sagaflow dead list` and `sagaflow dead requeue`.
const (
	deadArgs    = "list [flags] | requeue (--id ID... | --all --kind K) [flags]"
	deadSummary = "list or requeue dead outbox messages and dead letters"
	deadAbout   = "Dead outbox messages are messages sagaflow could not send (refused by the broker, or commands\n" +
		"the engine parked); dead letters are messages a consumer received and could not process.\n\n" +
		"dead list lists them, oldest first, one page at a time: both kinds, or the one --kind names\n" +
		"(--cursor needs --kind). --consumer selects dead letters only.\n\n" +
		"dead requeue puts back the ids given with --id (a UUID is an outbox message, a number a dead\n" +
		"letter; repeat the flag or separate ids with commas), or with --all every item of --kind that\n" +
		"matches --consumer, --topic and --since, oldest first, at most --max. A dead outbox message\n" +
		"becomes pending again with its attempts reset. A dead letter is published to its topic again,\n" +
		"through the outbox, with its original key, value and headers (so consumers that processed it\n" +
		"skip it by its message id), and its consumer's inbox forgets it, so that consumer processes it.\n" +
		"A relay must run for them to be published. What cannot be requeued is printed with the reason\n" +
		"and the rest go on; the exit code is then 1. --dry-run reports the same from a transaction that\n" +
		"is rolled back, changes nothing, and exits 0 whatever it found, as every dry run."
)

// deadListOnly and deadRequeueOnly are the flags of one subcommand only.
var (
	deadListOnly    = []string{"limit", "cursor", "requeued"}
	deadRequeueOnly = []string{"id", "all", "max", "dry-run"}
)

// deadFlags are the flags of both subcommands.
type deadFlags struct {
	kind            string
	consumer, topic string
	since           time.Time
	limit           int
	cursor          string
	requeued        bool
	ids             idsFlag
	all             bool
	maxN            int
	dryRun          bool
}

func setupDead(fs *flag.FlagSet) runFunc {
	f := &deadFlags{}
	fs.StringVar(&f.kind, "kind", "", "only this `kind`: outbox (dead outbox messages) or letters (dead letters)")
	fs.StringVar(&f.consumer, "consumer", "", "only the dead letters of the consumer with this `name`")
	fs.StringVar(&f.topic, "topic", "", "only messages of the topic with this `name`")
	timeVar(fs, &f.since, "since", "only what was parked at or after this `time`")
	fs.IntVar(&f.limit, "limit", 0, fmt.Sprintf("list: page size, `n` (default %d, at most %d)", saga.ListLimitDefault, saga.ListLimitMax))
	fs.StringVar(&f.cursor, "cursor", "", "list: continue a previous listing of --kind from its next-page `cursor`")
	fs.BoolVar(&f.requeued, "requeued", false, "list: include dead letters that were requeued already")
	fs.Var(&f.ids, "id", "requeue: the `id` of a dead outbox message (a UUID) or of a dead letter (a number); repeatable, or comma separated")
	fs.BoolVar(&f.all, "all", false, "requeue: every item of --kind that matches the filters, at most --max")
	fs.IntVar(&f.maxN, "max", 0, fmt.Sprintf("requeue --all: at most `n` items (default %d, at most %d)",
		saga.RequeueMaxDefault, saga.RequeueMaxLimit))
	fs.BoolVar(&f.dryRun, "dry-run", false, "requeue: report what would be requeued and change nothing")
	return func(ctx context.Context, c *cli, args []string) error {
		if len(args) == 0 {
			return usageErrorf("dead: missing subcommand: list or requeue (run 'sagaflow help dead')")
		}
		sub, rest := args[0], args[1:]
		if err := noArgs("dead "+sub, rest); err != nil {
			return err
		}
		if f.kind != "" && f.kind != string(saga.DeadOutbox) && f.kind != string(saga.DeadLetters) {
			return usageErrorf("dead %s: --kind %q: want %s or %s", sub, f.kind, saga.DeadOutbox, saga.DeadLetters)
		}
		if f.kind == string(saga.DeadOutbox) && f.consumer != "" {
			return usageErrorf("dead %s: --consumer selects dead letters, not --kind outbox", sub)
		}
		var wrong []string
		switch sub {
		case "list":
			wrong = setFlags(fs, deadRequeueOnly)
		case "requeue":
			wrong = setFlags(fs, deadListOnly)
		default:
			return usageErrorf("dead: unknown subcommand %q: want %s (run 'sagaflow help dead')", sub, strings.Join(deadSubcommands, " or "))
		}
		if len(wrong) > 0 {
			return usageErrorf("dead %s: %s do not apply (run 'sagaflow help dead')", sub, strings.Join(wrong, ", "))
		}
		if sub == "list" {
			return deadList(ctx, c, f)
		}
		return deadRequeue(ctx, c, f, fs)
	}
}

// setFlags lists those of names that were given on fs, as --name.
func setFlags(fs *flag.FlagSet, names []string) []string {
	var set []string
	fs.Visit(func(fl *flag.Flag) {
		if slices.Contains(names, fl.Name) {
			set = append(set, "--"+fl.Name)
		}
	})
	return set
}

// idsFlag collects the ids of --id: UUIDs of outbox messages and numbers
// of dead letters.
type idsFlag struct {
	messages []uuid.UUID
	letters  []int64
}

func (f *idsFlag) String() string {
	if f == nil {
		return ""
	}
	var parts []string
	for _, id := range f.messages {
		parts = append(parts, id.String())
	}
	for _, id := range f.letters {
		parts = append(parts, strconv.FormatInt(id, 10))
	}
	return strings.Join(parts, ",")
}

func (f *idsFlag) Set(v string) error {
	for part := range strings.SplitSeq(v, ",") {
		part = strings.TrimSpace(part)
		if n, err := strconv.ParseInt(part, 10, 64); err == nil && n > 0 {
			f.letters = append(f.letters, n)
			continue
		}
		id, err := uuid.Parse(part)
		if err != nil {
			return fmt.Errorf("%q is neither an outbox message's UUID nor a dead letter's number", part)
		}
		f.messages = append(f.messages, id)
	}
	return nil
}

// deadMessageJSON and deadLetterJSON are the --json forms.
type deadMessageJSON struct {
	ID            uuid.UUID  `json:"id"`
	Topic         string     `json:"topic"`
	Delivery      string     `json:"delivery"`
	AggregateType string     `json:"aggregate_type"`
	AggregateID   string     `json:"aggregate_id"`
	Type          string     `json:"type"`
	SagaID        *uuid.UUID `json:"saga_id,omitempty"`
	StepKey       *string    `json:"step_key,omitempty"`
	Attempts      int        `json:"attempts"`
	LastError     string     `json:"last_error"`
	PayloadBytes  int        `json:"payload_bytes"`
	CreatedAt     time.Time  `json:"created_at"`
}

type deadLetterJSON struct {
	ID         int64             `json:"id"`
	Consumer   string            `json:"consumer"`
	MessageID  string            `json:"message_id,omitempty"`
	Topic      string            `json:"topic"`
	Partition  *int              `json:"partition,omitempty"`
	Offset     *int64            `json:"offset,omitempty"`
	Key        []byte            `json:"key"` // base64
	ValueBytes int               `json:"value_bytes"`
	Headers    map[string]string `json:"headers"`
	Reason     string            `json:"reason"`
	CreatedAt  time.Time         `json:"created_at"`
	RequeuedAt *time.Time        `json:"requeued_at,omitempty"`
}

func deadList(ctx context.Context, c *cli, f *deadFlags) error {
	if f.limit < 0 || f.limit > saga.ListLimitMax {
		return usageErrorf("dead list: --limit %d is outside 0..%d", f.limit, saga.ListLimitMax)
	}
	if f.cursor != "" && f.kind == "" {
		return usageErrorf("dead list: --cursor continues one kind: give --kind too")
	}
	engine, err := c.connect(ctx)
	if err != nil {
		return err
	}
	opts := &saga.DeadOpts{Consumer: f.consumer, Topic: f.topic, Since: f.since, IncludeRequeued: f.requeued,
		Cursor: f.cursor, Limit: f.limit}
	// --consumer selects dead letters only.
	wantMessages := f.kind == string(saga.DeadOutbox) || f.kind == "" && f.consumer == ""
	wantLetters := f.kind != string(saga.DeadOutbox)
	var msgs *saga.DeadMessagePage
	var letters *saga.DeadLetterPage
	if wantMessages {
		if msgs, err = engine.DeadMessages(ctx, opts); err != nil {
			return c.opError(err, "dead list")
		}
	}
	if wantLetters {
		if letters, err = engine.DeadLetters(ctx, opts); err != nil {
			return c.opError(err, "dead list")
		}
	}
	if c.g.json {
		doc := struct {
			Messages           []deadMessageJSON `json:"messages,omitempty"`
			MessagesNextCursor string            `json:"messages_next_cursor,omitempty"`
			Letters            []deadLetterJSON  `json:"letters,omitempty"`
			LettersNextCursor  string            `json:"letters_next_cursor,omitempty"`
		}{}
		if msgs != nil {
			doc.Messages, doc.MessagesNextCursor = make([]deadMessageJSON, len(msgs.Messages)), msgs.NextCursor
			for i, m := range msgs.Messages {
				doc.Messages[i] = deadMessageJSON(m)
			}
		}
		if letters != nil {
			doc.Letters, doc.LettersNextCursor = make([]deadLetterJSON, len(letters.Letters)), letters.NextCursor
			for i, l := range letters.Letters {
				doc.Letters[i] = deadLetterJSON(l)
			}
		}
		return writeJSON(c.stdout, doc)
	}
	if msgs != nil {
		printDeadMessages(c, msgs, letters != nil)
	}
	if letters != nil {
		if msgs != nil {
			fmt.Fprintln(c.stdout)
		}
		printDeadLetters(c, letters, msgs != nil)
	}
	return nil
}

// esc makes stored text safe for a terminal and a table cell.
func esc(s string, limit int) string {
	return oneLine(safetext.Escape(s), limit)
}

func printDeadMessages(c *cli, page *saga.DeadMessagePage, heading bool) {
	if heading {
		fmt.Fprintln(c.stdout, "DEAD OUTBOX MESSAGES")
	}
	if len(page.Messages) == 0 {
		fmt.Fprintln(c.stdout, "no dead outbox messages match")
		return
	}
	tw := newTable(c.stdout)
	fmt.Fprintln(tw, "ID\tTOPIC\tDELIVERY\tTYPE\tKEY\tATTEMPTS\tCREATED\tREASON")
	for _, m := range page.Messages {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\n", m.ID, esc(m.Topic, 60), m.Delivery, orDash(esc(m.Type, 60)),
			orDash(esc(m.AggregateID, 40)), m.Attempts, formatTime(m.CreatedAt), orDash(esc(m.LastError, 200)))
	}
	tw.Flush()
	if page.NextCursor != "" {
		fmt.Fprintf(c.stdout, "\nnext page: --kind %s --cursor %s\n", saga.DeadOutbox, page.NextCursor)
	}
}

func printDeadLetters(c *cli, page *saga.DeadLetterPage, heading bool) {
	if heading {
		fmt.Fprintln(c.stdout, "DEAD LETTERS")
	}
	if len(page.Letters) == 0 {
		fmt.Fprintln(c.stdout, "no dead letters match")
		return
	}
	tw := newTable(c.stdout)
	fmt.Fprintln(tw, "ID\tCONSUMER\tTOPIC\tPOSITION\tMESSAGE ID\tKEY\tCREATED\tREQUEUED\tREASON")
	for _, l := range page.Letters {
		pos := "-"
		if l.Partition != nil && l.Offset != nil {
			pos = fmt.Sprintf("%d/%d", *l.Partition, *l.Offset)
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", l.ID, esc(l.Consumer, 40), orDash(esc(l.Topic, 60)), pos,
			orDash(esc(l.MessageID, 40)), orDash(esc(string(l.Key), 40)), formatTime(l.CreatedAt), formatTimePtr(l.RequeuedAt),
			esc(l.Reason, 200))
	}
	tw.Flush()
	if page.NextCursor != "" {
		fmt.Fprintf(c.stdout, "\nnext page: --kind %s --cursor %s\n", saga.DeadLetters, page.NextCursor)
	}
}

type requeuedLetterJSON struct {
	ID        int64     `json:"id"`
	Consumer  string    `json:"consumer"`
	Topic     string    `json:"topic"`
	OutboxID  uuid.UUID `json:"outbox_id"`
	MessageID string    `json:"message_id,omitempty"`
}

type requeueFailureJSON struct {
	Kind  saga.DeadKind `json:"kind"`
	ID    string        `json:"id"`
	Error string        `json:"error"`
}

func deadRequeue(ctx context.Context, c *cli, f *deadFlags, fs *flag.FlagSet) error {
	ids := len(f.ids.messages) + len(f.ids.letters)
	switch {
	case f.all == (ids > 0):
		return usageErrorf("dead requeue: give --id or --all (run 'sagaflow help dead')")
	case ids > 0:
		if set := setFlags(fs, []string{"kind", "consumer", "topic", "since", "max"}); len(set) > 0 {
			return usageErrorf("dead requeue: %s select with --all only", strings.Join(set, ", "))
		}
	case f.kind == "" && f.consumer == "":
		return usageErrorf("dead requeue --all: give --kind (%s or %s)", saga.DeadOutbox, saga.DeadLetters)
	}
	if err := checkMax("dead requeue", fs, f.maxN, saga.RequeueMaxLimit); err != nil {
		return err
	}
	engine, err := c.connect(ctx)
	if err != nil {
		return err
	}
	res, err := engine.RequeueDead(ctx, &saga.RequeueOpts{MessageIDs: f.ids.messages, LetterIDs: f.ids.letters,
		All: f.all, Kind: saga.DeadKind(f.kind), Consumer: f.consumer, Topic: f.topic, Since: f.since, Max: f.maxN,
		DryRun: f.dryRun})
	if err != nil {
		if res != nil {
			err = fmt.Errorf("%w (stopped after requeueing %d outbox messages and %d dead letters)",
				err, len(res.Messages), len(res.Letters))
		}
		return c.opError(err, "dead requeue")
	}
	if c.g.json {
		letters := make([]requeuedLetterJSON, len(res.Letters))
		for i, l := range res.Letters {
			letters[i] = requeuedLetterJSON(l)
		}
		failed := make([]requeueFailureJSON, len(res.Failed))
		for i, fl := range res.Failed {
			failed[i] = requeueFailureJSON{Kind: fl.Kind, ID: fl.ID, Error: fl.Err.Error()}
		}
		if err := writeJSON(c.stdout, struct {
			Messages []uuid.UUID          `json:"messages"`
			Letters  []requeuedLetterJSON `json:"letters"`
			Failed   []requeueFailureJSON `json:"failed"`
			DryRun   bool                 `json:"dry_run"`
		}{nonNil(res.Messages), letters, failed, res.DryRun}); err != nil {
			return err
		}
	} else {
		printRequeue(c, res)
	}
	if len(res.Failed) > 0 && !res.DryRun {
		return &silentError{code: exitFailed}
	}
	return nil
}

func printRequeue(c *cli, res *saga.RequeueResult) {
	n := len(res.Messages) + len(res.Letters)
	if res.DryRun {
		fmt.Fprintf(c.stdout, "dry run: %d would be requeued, %d would fail; nothing was changed\n", n, len(res.Failed))
	} else {
		fmt.Fprintf(c.stdout, "requeued %d, failed %d\n", n, len(res.Failed))
	}
	tw := newTable(c.stdout)
	for _, id := range res.Messages {
		fmt.Fprintf(tw, "outbox\t%s\tpending again\n", id)
	}
	for _, l := range res.Letters {
		fmt.Fprintf(tw, "letter\t%d\tsent again as outbox message %s, message id %s\n", l.ID, l.OutboxID, orDash(esc(l.MessageID, 80)))
	}
	for _, fl := range res.Failed {
		kind := "outbox"
		if fl.Kind == saga.DeadLetters {
			kind = "letter"
		}
		fmt.Fprintf(tw, "failed\t%s %s\t%s\n", kind, fl.ID, esc(fl.Err.Error(), 300))
	}
	tw.Flush()
}

// deadSubcommands are dead's subcommands.
var deadSubcommands = []string{"list", "requeue"}
