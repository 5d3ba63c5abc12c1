package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

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
		sigs, err := engine.Signals(ctx, id)
		if err != nil {
			return c.opError(err, "show %s: signals", id)
		}
		if c.g.json {
			return writeJSON(c.stdout, showDoc{Instance: in, Signals: signalDocs(sigs)})
		}
		printSaga(c.stdout, in, sigs)
		return nil
	}
}

// showDoc is the --json output of show: the saga, and the signals sent to
// it, oldest first.
type showDoc struct {
	*saga.Instance
	Signals []signalInfoDoc `json:"signals"`
}

// signalInfoDoc is a [saga.SignalInfo] in --json output.
type signalInfoDoc struct {
	Seq         int64           `json:"seq"`
	Name        string          `json:"name"`
	ID          string          `json:"id"`
	Status      string          `json:"status"`
	Error       string          `json:"error,omitempty"`
	Step        string          `json:"step,omitempty"`
	Epoch       int             `json:"epoch"`
	Payload     json.RawMessage `json:"payload,omitempty"`
	CreatedAt   time.Time       `json:"created_at"`
	DeliveredAt *time.Time      `json:"delivered_at,omitempty"`
}

func signalDocs(sigs []saga.SignalInfo) []signalInfoDoc {
	out := make([]signalInfoDoc, len(sigs))
	for i, s := range sigs {
		out[i] = signalInfoDoc{Seq: s.Seq, Name: s.Name, ID: s.ID, Status: s.Status, Error: s.Error, Step: s.Step,
			Epoch: s.Epoch, CreatedAt: s.CreatedAt, DeliveredAt: s.DeliveredAt}
		// A payload from a foreign writer need not be JSON: it is then
		// given as a JSON string, so that the document stays valid.
		if json.Valid(s.Payload) {
			out[i].Payload = s.Payload
		} else if len(s.Payload) > 0 {
			out[i].Payload, _ = json.Marshal(string(s.Payload)) // a string always encodes
		}
	}
	return out
}

// printSaga prints a saga for a reader: header, timeline, signals, state.
// Every stored string is escaped (see [cell] and [oneLine]).
func printSaga(w io.Writer, in *saga.Instance, sigs []saga.SignalInfo) {
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
	row("waits for", formatWait(in.Wait))
	if in.Concurrency != nil {
		row("concurrency key", formatConcurrency(in.Concurrency))
	}
	if p := in.Paused; p != nil {
		by := "this saga"
		if p.Type {
			by = "its type"
		}
		at := ""
		if p.Step != "" {
			at = " at step " + cell(p.Step)
		}
		row("paused", fmt.Sprintf("since %s, %s%s (%s): %s", formatTime(p.At), by, at, cell(p.Code), oneLine(p.Reason, 500)))
	}
	row("deadline", formatTimePtr(in.Deadline))
	if in.ParentID != nil {
		row("parent", in.ParentID.String())
	} else {
		row("parent", "-")
	}
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

	if len(sigs) > 0 {
		fmt.Fprintf(w, "\nsignals (%d):\n", len(sigs))
		tw = newTable(w)
		for _, s := range sigs {
			at := ""
			if s.Step != "" {
				at = fmt.Sprintf("step %s, epoch %d", cell(s.Step), s.Epoch)
			}
			fmt.Fprintf(tw, "  %d\t%s\t%s\tid %s\t%s\t%s\t%s\n", s.Seq, formatTime(s.CreatedAt), cell(s.Name),
				cell(s.ID), cell(s.Status), at, oneLine(s.Error, errorWidth))
		}
		tw.Flush()
	}

	fmt.Fprintln(w, "\nstate:")
	fmt.Fprintln(w, strings.TrimRight(indentJSON(in.State), "\n"))
}
