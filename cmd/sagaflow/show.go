package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/saga"
)

// errorWidth bounds an error message in the timeline; --json has it whole.
const errorWidth = 160

func setupShow(*flag.FlagSet) runFunc {
	return func(ctx context.Context, c *cli, args []string) error {
		id, err := parseID("show", args)
		if err != nil {
			return err
		}
		engine, err := c.connect(ctx)
		if err != nil {
			return err
		}
		in, err := engine.Get(ctx, id)
		if err != nil {
			return c.opError(err, "show %s", id)
		}
		if c.g.json {
			return writeJSON(c.stdout, in)
		}
		printSaga(c.stdout, in)
		return nil
	}
}

// printSaga prints a saga for a reader: header, timeline, state. Every
// stored string is escaped (see [cell] and [oneLine]).
func printSaga(w io.Writer, in *saga.Instance) {
	tw := newTable(w)
	row := func(k, v string) { fmt.Fprintf(tw, "%s:\t%s\n", k, v) }
	row("id", in.ID.String())
	row("name", cell(in.Name))
	row("business key", cell(in.BusinessKey))
	row("status", cell(in.Status))
	row("step", fmt.Sprintf("%s (%s, epoch %d, attempt %d)", cell(in.Step), cell(in.Direction), in.Epoch, in.Attempt))
	row("version", strconv.FormatInt(in.Version, 10))
	row("created", formatTime(in.CreatedAt))
	row("updated", formatTime(in.UpdatedAt))
	row("ended", formatTimePtr(in.EndedAt))
	row("next check", formatTimePtr(in.NextCheckAt))
	if e := in.LastError; e != nil {
		msg := withCode(e.Message, e.Code, 1000)
		if e.Step != "" {
			msg += " at step " + cell(e.Step)
		}
		row("last error", msg)
	} else {
		row("last error", "-")
	}
	tw.Flush()

	fmt.Fprintf(w, "\ntimeline (%d events):\n", len(in.History))
	origin := in.CreatedAt
	if len(in.History) > 0 {
		origin = in.History[0].At
	}
	tw = newTable(w)
	for _, ev := range in.History {
		attempt := ""
		if ev.Attempt > 0 {
			attempt = "attempt " + strconv.Itoa(ev.Attempt)
		}
		// The detail holds what the error does not: a replay's or a
		// cancel's reason, a step's duration.
		detail := ""
		if len(ev.Detail) > 0 && string(ev.Detail) != "null" && string(ev.Detail) != "{}" {
			detail = oneLine(compactJSON(ev.Detail), errorWidth)
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", formatTime(ev.At), formatOffset(ev.At.Sub(origin)),
			safetext.Escape(ev.Type), safetext.Escape(ev.Step), safetext.Escape(string(ev.Direction)), attempt,
			withCode(ev.Error, ev.ErrorCode, errorWidth), detail)
	}
	tw.Flush()

	fmt.Fprintln(w, "\nstate:")
	fmt.Fprintln(w, strings.TrimRight(indentJSON(in.State), "\n"))
}
