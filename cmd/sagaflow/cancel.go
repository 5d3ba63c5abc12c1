package main

import (
	"context"
	"flag"
	"fmt"

	"github.com/google/uuid"
)

func setupCancel(fs *flag.FlagSet) runFunc {
	reason := fs.String("reason", "cancelled with the sagaflow CLI", "`text` recorded as the saga's last error")
	return func(ctx context.Context, c *cli, args []string) error {
		id, err := parseID("cancel", args)
		if err != nil {
			return err
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
		msg := fmt.Sprintf("cancel of saga %s requested: an engine that knows the saga will compensate it", id)
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
