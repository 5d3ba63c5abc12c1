package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"slices"
	"strings"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/saga"
)

// reasonDefault is recorded in the history of a replay that gives none.
const reasonDefault = "replayed with the sagaflow CLI"

// bulkOnly are the flags of `replay` that only --bulk takes.
var bulkOnly = []string{"name", "status", "created-after", "created-before", "ended-after", "ended-before",
	"failed-step", "error-code", "max", "rate", "dry-run"}

func setupReplay(fs *flag.FlagSet) runFunc {
	var o saga.BulkReplayOpts
	bulk := fs.Bool("bulk", false, "replay every saga that matches the filters instead of one saga")
	fs.StringVar(&o.FromStep, "from-step", "", "re-run from this `step` under a new epoch, instead of resuming where the saga failed")
	fs.StringVar(&o.Reason, "reason", reasonDefault, "`text` recorded in the saga's history")
	fs.StringVar(&o.Name, "name", "", "--bulk: only sagas of this `name`")
	fs.Var(statusFlag{&o.Statuses}, "status", "--bulk: only sagas in these `statuses`, comma separated (default failed)")
	timeVar(fs, &o.CreatedAfter, "created-after", "--bulk: only sagas created at or after this `time`")
	timeVar(fs, &o.CreatedBefore, "created-before", "--bulk: only sagas created before this `time`")
	timeVar(fs, &o.EndedAfter, "ended-after", "--bulk: only sagas that ended at or after this `time`")
	timeVar(fs, &o.EndedBefore, "ended-before", "--bulk: only sagas that ended before this `time`")
	fs.StringVar(&o.FailedStep, "failed-step", "", "--bulk: only sagas whose last error came from this `step`")
	fs.StringVar(&o.ErrorCode, "error-code", "", "--bulk: only sagas whose last error has this `code`")
	fs.IntVar(&o.Max, "max", 0, fmt.Sprintf("--bulk: replay at most `n` sagas (default %d, at most %d)",
		saga.BulkReplayMaxDefault, saga.BulkReplayMaxLimit))
	fs.Float64Var(&o.RatePerSecond, "rate", 0, fmt.Sprintf("--bulk: at most `r` replays per second (default %d)", saga.ReplayRateDefault))
	fs.BoolVar(&o.DryRun, "dry-run", false, "--bulk: list what would be replayed and change nothing")
	plan := fs.Bool("plan", false, "show which steps would run again, which compensations would run, and which keys are reused or new; change nothing")
	return func(ctx context.Context, c *cli, args []string) error {
		if *bulk {
			if err := noArgs("replay --bulk", args); err != nil {
				return err
			}
			if err := checkLimits("replay --bulk", fs, o.Max, o.RatePerSecond); err != nil {
				return err
			}
			if err := checkBulkStatuses(o.Statuses, o.FromStep); err != nil {
				return err
			}
			if *plan {
				o.DryRun = true
				return planBulk(ctx, c, o)
			}
			return replayBulk(ctx, c, o)
		}
		var set []string
		fs.Visit(func(f *flag.Flag) {
			if slices.Contains(bulkOnly, f.Name) {
				set = append(set, "--"+f.Name)
			}
		})
		if len(set) > 0 {
			return usageErrorf("replay: %s only apply with --bulk", strings.Join(set, ", "))
		}
		id, err := parseID("replay", args)
		if err != nil {
			return err
		}
		if *plan {
			action := saga.PlanResume
			if o.FromStep != "" {
				action = saga.PlanRerun
			}
			p, err := planOne(ctx, c, id, action, o.FromStep)
			if err != nil {
				return err
			}
			return printPlan(c, id, o.FromStep, p)
		}
		return replayOne(ctx, c, id, o.FromStep, o.Reason)
	}
}

func replayOne(ctx context.Context, c *cli, id uuid.UUID, from, reason string) error {
	engine, err := c.connect(ctx)
	if err != nil {
		return err
	}
	action := "resume"
	if from != "" {
		action = "rerun"
		err = engine.Rerun(ctx, id, from, reason)
	} else {
		err = engine.Resume(ctx, id, reason)
	}
	if err != nil {
		if errors.Is(err, saga.ErrNotReplayable) && from == "" {
			err = fmt.Errorf("%w (to re-run an ended saga, pass --from-step)", err)
		}
		return c.opError(err, "replay %s", id)
	}
	if c.g.json {
		return writeJSON(c.stdout, struct {
			ID       uuid.UUID `json:"id"`
			Action   string    `json:"action"`
			FromStep string    `json:"from_step,omitempty"`
			Reason   string    `json:"reason"`
		}{id, action, from, reason})
	}
	if from != "" {
		fmt.Fprintf(c.stdout, "saga %s re-runs from step %s under a new epoch; an engine that knows the saga runs it\n",
			id, safetext.Escape(from))
	} else {
		fmt.Fprintf(c.stdout, "saga %s resumes where it failed; an engine that knows the saga runs it\n", id)
	}
	return nil
}

// checkBulkStatuses refuses a bulk replay that could replay nothing:
// without a step to re-run from, only failed sagas resume; with one, only
// ended sagas re-run. The engine would report each such saga as an error.
func checkBulkStatuses(statuses []saga.Status, from string) error {
	var wrong []string
	for _, st := range statuses {
		if from == "" && st != saga.StatusFailed || from != "" && !st.Terminal() {
			wrong = append(wrong, string(st))
		}
	}
	switch {
	case len(wrong) == 0:
		return nil
	case from == "":
		return usageErrorf("replay --bulk: --status %s: only failed sagas resume; to re-run ended sagas from a step, pass --from-step",
			strings.Join(wrong, ","))
	default:
		return usageErrorf("replay --bulk: --status %s: only ended sagas (completed, compensated, failed) re-run from a step",
			strings.Join(wrong, ","))
	}
}

type bulkErrorJSON struct {
	ID    uuid.UUID `json:"id"`
	Error string    `json:"error"`
}

// replayBulk runs a bulk replay. Its exit code: 0 when every matched saga
// was replayed, when none matched, and for every dry run that ran; 1 when
// a matched saga could not be replayed or the run stopped early (each
// outcome is printed, what was done included); 2 for bad usage.
func replayBulk(ctx context.Context, c *cli, o saga.BulkReplayOpts) error {
	engine, err := c.connect(ctx)
	if err != nil {
		return err
	}
	res, err := engine.ReplayBulk(ctx, o)
	if err != nil {
		if res == nil {
			return c.opError(err, "replay --bulk")
		}
		// Stopped early (a database error, --timeout): say what was done
		// before saying why it stopped.
		err = c.opError(fmt.Errorf("%w (stopped after replaying %d of %d matched sagas)", err, len(res.Replayed), len(res.Matched)),
			"replay --bulk")
		if !c.g.json {
			printBulk(c, res, o.FromStep)
			return err
		}
		// One document: what was done, and why it stopped.
		doc := bulkJSON(res)
		var ce *cliError
		if !errors.As(err, &ce) {
			ce = &cliError{code: exitFailed, msg: err.Error()}
		}
		doc.Error, doc.Code = c.secrets.redact(ce.msg), ce.code
		if werr := writeJSON(c.stdout, doc); werr != nil {
			return err
		}
		return &silentError{code: ce.code}
	}
	if c.g.json {
		if err := writeJSON(c.stdout, bulkJSON(res)); err != nil {
			return err
		}
	} else {
		printBulk(c, res, o.FromStep)
	}
	if len(res.Errors) > 0 && !res.DryRun {
		// The results are printed; the exit code says not all went well.
		return &silentError{code: exitFailed}
	}
	return nil
}

// printBulk prints a bulk replay's outcome: a summary line that always
// says what happened, then one line per saga.
func printBulk(c *cli, res *saga.BulkReplayResult, from string) {
	verb := "resume"
	if from != "" {
		verb = "re-run from " + safetext.Escape(from)
	}
	reason := func(e saga.BulkReplayError) string {
		return oneLine(trimRepeat(e.Err.Error(), "replay "+e.ID.String()), 300)
	}
	tw := newTable(c.stdout)
	switch {
	case res.DryRun && len(res.Matched) == 0 && len(res.Errors) == 0:
		fmt.Fprintln(c.stdout, "dry run: no sagas match; nothing would be replayed")
	case res.DryRun:
		skipped := ""
		if len(res.Errors) > 0 {
			skipped = fmt.Sprintf(", %d would be skipped", len(res.Errors))
		}
		fmt.Fprintf(c.stdout, "dry run: %d sagas match%s; nothing was changed\n", len(res.Matched), skipped)
		for _, id := range res.Matched {
			fmt.Fprintf(tw, "would %s\t%s\n", verb, id)
		}
		for _, e := range res.Errors {
			fmt.Fprintf(tw, "would skip\t%s\t%s\n", e.ID, reason(e))
		}
	case len(res.Matched) == 0 && len(res.Errors) == 0:
		fmt.Fprintln(c.stdout, "no sagas match; nothing was replayed")
	default:
		fmt.Fprintf(c.stdout, "matched %d, replayed %d, errors %d\n", len(res.Matched), len(res.Replayed), len(res.Errors))
		for _, id := range res.Replayed {
			fmt.Fprintf(tw, "replayed\t%s\t%s\n", id, verb)
		}
		for _, e := range res.Errors {
			fmt.Fprintf(tw, "error\t%s\t%s\n", e.ID, reason(e))
		}
	}
	tw.Flush()
}

// nonNil makes an empty list encode as [] rather than null.
func nonNil(ids []uuid.UUID) []uuid.UUID {
	if ids == nil {
		return []uuid.UUID{}
	}
	return ids
}

// bulkResultJSON is a bulk replay's --json document; Error and Code are set
// when it stopped early.
type bulkResultJSON struct {
	Matched  []uuid.UUID     `json:"matched"`
	Replayed []uuid.UUID     `json:"replayed"`
	Errors   []bulkErrorJSON `json:"errors"`
	DryRun   bool            `json:"dry_run"`
	Error    string          `json:"error,omitempty"`
	Code     int             `json:"code,omitempty"`
}

func bulkJSON(res *saga.BulkReplayResult) bulkResultJSON {
	errs := make([]bulkErrorJSON, 0, len(res.Errors))
	for _, e := range res.Errors {
		errs = append(errs, bulkErrorJSON{ID: e.ID, Error: e.Err.Error()})
	}
	return bulkResultJSON{Matched: nonNil(res.Matched), Replayed: nonNil(res.Replayed), Errors: errs, DryRun: res.DryRun}
}
