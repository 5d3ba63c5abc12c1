package main

import (
	"context"
	"flag"
	"fmt"
	"strconv"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/saga"
)

// listFlags are the filters of `sagaflow list`.
type listFlags struct {
	opts       saga.ListOpts
	failedStep string
	errorCode  string
}

func setupList(fs *flag.FlagSet) runFunc {
	f := &listFlags{}
	fs.StringVar(&f.opts.Name, "name", "", "only sagas of this `name`")
	fs.Var(statusFlag{&f.opts.Statuses}, "status", "only sagas in these `statuses`, comma separated: "+statusNames())
	fs.StringVar(&f.opts.BusinessKey, "business-key", "", "only the saga with this business `key`")
	timeVar(fs, &f.opts.CreatedAfter, "created-after", "only sagas created at or after this `time`")
	timeVar(fs, &f.opts.CreatedBefore, "created-before", "only sagas created before this `time`")
	fs.StringVar(&f.failedStep, "failed-step", "", "only sagas whose last error came from this `step`")
	fs.StringVar(&f.errorCode, "error-code", "", "only sagas whose last error has this `code`")
	fs.BoolVar(&f.opts.Waiting, "waiting", false, "only sagas that wait for a timer, a signal or a child saga")
	fs.StringVar(&f.opts.ConcurrencyKey, "concurrency-key", "", "only sagas started with this concurrency `key`")
	fs.BoolVar(&f.opts.Queued, "queued", false, "only sagas waiting for a slot of their concurrency key")
	fs.BoolVar(&f.opts.Paused, "paused", false, "only sagas that are paused, on their own or with their type")
	fs.IntVar(&f.opts.Limit, "limit", 0, fmt.Sprintf("page size, `n` (default %d, at most %d)", saga.ListLimitDefault, saga.ListLimitMax))
	fs.StringVar(&f.opts.Cursor, "cursor", "", "continue a previous listing from its next-page `cursor`")
	return func(ctx context.Context, c *cli, args []string) error {
		if err := noArgs("list", args); err != nil {
			return err
		}
		if f.opts.Limit < 0 || f.opts.Limit > saga.ListLimitMax {
			return usageErrorf("list: --limit %d is outside 0..%d", f.opts.Limit, saga.ListLimitMax)
		}
		if _, err := c.connect(ctx); err != nil {
			return err
		}
		res, err := c.list(ctx, f)
		if err != nil {
			return c.opError(err, "list sagas")
		}
		if c.g.json {
			return writeJSON(c.stdout, struct {
				Sagas      []saga.Instance `json:"sagas"`
				NextCursor string          `json:"next_cursor,omitempty"`
			}{res.Sagas, res.NextCursor})
		}
		printSagaTable(c, res)
		return nil
	}
}

// list runs the listing.
func (c *cli) list(ctx context.Context, f *listFlags) (*saga.ListResult, error) {
	f.opts.FailedStep, f.opts.ErrorCode = f.failedStep, f.errorCode
	return c.engine.List(ctx, &f.opts)
}

func printSagaTable(c *cli, res *saga.ListResult) {
	if len(res.Sagas) == 0 {
		fmt.Fprintln(c.stdout, "no sagas match")
		return
	}
	tw := newTable(c.stdout)
	fmt.Fprintln(tw, "ID\tNAME\tSTATUS\tSTEP\tDIRECTION\tATTEMPT\tWAIT\tCREATED\tERROR CODE")
	for _, in := range res.Sagas {
		code := ""
		if in.LastError != nil {
			code = in.LastError.Code
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", in.ID, cell(in.Name), cell(in.Status), cell(in.Step),
			cell(in.Direction), strconv.Itoa(in.Attempt), listWait(&in), formatTime(in.CreatedAt), cell(code))
	}
	tw.Flush()
	if res.NextCursor != "" {
		fmt.Fprintf(c.stdout, "\nnext page: --cursor %s\n", safetext.Escape(res.NextCursor))
	}
}
