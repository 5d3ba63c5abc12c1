package main

import (
	"context"
	"flag"
	"fmt"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/saga"
)

func setupCancel(fs *flag.FlagSet) runFunc {
	reason := fs.String("reason", "cancelled with the sagaflow CLI", "`text` recorded as the saga's last error")
	plan := fs.Bool("plan", false, "show which compensations the cancel would run, and their keys; change nothing")
	return func(ctx context.Context, c *cli, args []string) error {
		id, err := parseID("cancel", args)
		if err != nil {
			return err
		}
		if *plan {
			p, err := planOne(ctx, c, id, saga.PlanCancel, "")
			if err != nil {
				return err
			}
			return printPlan(c, id, "", p)
		}
		engine, err := c.connect(ctx)
		if err != nil {
			return err
		}
		// The CLI registers no definitions, so it cannot compensate the saga
		// itself: it records a cancel request, which an engine that knows
		// the saga carries out.
		if err := engine.RequestCancel(ctx, id, *reason); err != nil {
			return c.opError(err, "cancel %s", id)
		}
		// Not "will compensate": past its pivot, or ended before an engine
		// applies it, the request is refused (review27 O6).
		msg := fmt.Sprintf("cancel of saga %s requested: an engine that knows the saga compensates it, "+
			"or refuses the request if the saga is past its pivot or ends first (its timeline says which)", id)
		if c.g.json {
			return writeJSON(c.stdout, struct {
				ID      uuid.UUID `json:"id"`
				Result  string    `json:"result"`
				Message string    `json:"message"`
			}{id, "requested", msg})
		}
		fmt.Fprintln(c.stdout, msg)
		return nil
	}
}
