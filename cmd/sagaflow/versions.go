package main

import (
	"context"
	"flag"
	"fmt"
	"strconv"
)

func setupVersions(*flag.FlagSet) runFunc {
	return func(ctx context.Context, c *cli, args []string) error {
		if err := noArgs("versions", args); err != nil {
			return err
		}
		engine, err := c.connect(ctx)
		if err != nil {
			return err
		}
		counts, err := engine.Versions(ctx)
		if err != nil {
			return c.opError(err, "versions")
		}
		if c.g.json {
			if counts == nil {
				return writeJSON(c.stdout, []any{})
			}
			return writeJSON(c.stdout, counts)
		}
		tw := newTable(c.stdout)
		fmt.Fprintln(tw, "NAME\tVERSION\tRUNNING\tCOMPENSATING\tFAILED")
		for _, v := range counts {
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\n", cell(v.Name), v.Version, strconv.FormatInt(v.Running, 10),
				strconv.FormatInt(v.Compensating, 10), strconv.FormatInt(v.Failed, 10))
		}
		return tw.Flush()
	}
}
