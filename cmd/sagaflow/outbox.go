package main

import (
	"context"
	"flag"
	"fmt"
	"strconv"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/saga"
)

func setupOutboxStatus(*flag.FlagSet) runFunc {
	return func(ctx context.Context, c *cli, args []string) error {
		if err := noArgs("outbox status", args); err != nil {
			return err
		}
		engine, err := c.connect(ctx)
		if err != nil {
			return err
		}
		st, err := engine.OutboxStatus(ctx)
		if err != nil {
			return c.opError(err, "outbox status")
		}
		if c.g.json {
			return writeJSON(c.stdout, struct {
				Pending                 int64   `json:"pending"`
				OldestPendingAgeSeconds float64 `json:"oldest_pending_age_seconds"`
				Dead                    int64   `json:"dead"`
				DeadLetters             int64   `json:"dead_letters"`
				Published               int64   `json:"published"`
			}{st.Pending, st.OldestPendingAge.Seconds(), st.Dead, st.DeadLetters, st.Published})
		}
		tw := newTable(c.stdout)
		fmt.Fprintf(tw, "pending:\t%s\n", strconv.FormatInt(st.Pending, 10))
		fmt.Fprintf(tw, "oldest pending age:\t%s\n", formatAge(st.OldestPendingAge))
		fmt.Fprintf(tw, "dead:\t%s\n", strconv.FormatInt(st.Dead, 10))
		fmt.Fprintf(tw, "dead letters:\t%s\n", strconv.FormatInt(st.DeadLetters, 10))
		fmt.Fprintf(tw, "published:\t%s\n", strconv.FormatInt(st.Published, 10))
		return tw.Flush()
	}
}

func setupOutboxReplay(fs *flag.FlagSet) runFunc {
	var o outbox.ReplayOpts
	fs.StringVar(&o.Topic, "topic", "", "only messages of this `topic`")
	fs.StringVar(&o.Type, "type", "", "only messages of this `type`")
	fs.StringVar(&o.Key, "aggregate-id", "", "only messages with this aggregate `id` (partition key)")
	timeVar(fs, &o.PublishedAfter, "published-after", "only messages published at or after this `time`")
	timeVar(fs, &o.PublishedBefore, "published-before", "only messages published before this `time`")
	fs.IntVar(&o.Max, "max", 0, fmt.Sprintf("replay at most `n` messages (default %d, at most %d)",
		saga.BulkReplayMaxDefault, saga.BulkReplayMaxLimit))
	fs.Float64Var(&o.RatePerSecond, "rate", 0, fmt.Sprintf("at most `r` messages per second (default %d)", saga.ReplayRateDefault))
	fs.BoolVar(&o.DryRun, "dry-run", false, "list what would be replayed and change nothing")
	return func(ctx context.Context, c *cli, args []string) error {
		if err := noArgs("outbox replay", args); err != nil {
			return err
		}
		if err := checkLimits("outbox replay", fs, o.Max, o.RatePerSecond); err != nil {
			return err
		}
		engine, err := c.connect(ctx)
		if err != nil {
			return err
		}
		res, err := engine.ReplayOutbox(ctx, o)
		if err != nil {
			if res != nil {
				err = fmt.Errorf("%w (stopped after %d of %d matched messages)", err, res.Republished, len(res.Matched))
			}
			return c.opError(err, "outbox replay")
		}
		if c.g.json {
			return writeJSON(c.stdout, struct {
				Matched     []uuid.UUID `json:"matched"`
				Republished int64       `json:"republished"`
				DryRun      bool        `json:"dry_run"`
			}{nonNil(res.Matched), res.Republished, res.DryRun})
		}
		switch {
		case len(res.Matched) == 0 && res.DryRun:
			fmt.Fprintln(c.stdout, "dry run: no published messages match; nothing would be republished")
		case len(res.Matched) == 0:
			fmt.Fprintln(c.stdout, "no published messages match; nothing was republished")
		case res.DryRun:
			fmt.Fprintf(c.stdout, "dry run: %d published messages match; nothing was changed\n", len(res.Matched))
		default:
			fmt.Fprintf(c.stdout, "republished %d of %d matched messages\n", res.Republished, len(res.Matched))
		}
		for _, id := range res.Matched {
			fmt.Fprintln(c.stdout, id)
		}
		return nil
	}
}
