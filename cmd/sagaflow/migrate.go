package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/sagaflow/sagaflow/migrations"
)

type migrationJSON struct {
	Version int    `json:"version"`
	Name    string `json:"name"`
}

func setupMigrate(fs *flag.FlagSet) runFunc {
	printSQL := fs.Bool("print", false, "print the migrations' SQL for --schema instead of applying them (needs no database)")
	exportDir := fs.String("export", "", "write one SQL file per migration version for --schema into `dir`, for goose, atlas, tern or your own tool, instead of applying them (needs no database)")
	var grantsFor *string
	fs.Func("print-grants", "print the GRANT statements that give `role` what sagaflow needs at run time on --schema, without DDL (needs no database)",
		func(v string) error { grantsFor = &v; return nil })
	return func(ctx context.Context, c *cli, args []string) error {
		if err := noArgs("migrate", args); err != nil {
			return err
		}
		// Each of these replaces applying the migrations with its own
		// output; two at once would silently print only one.
		var modes []string
		for _, m := range []struct {
			name string
			on   bool
		}{{"--print", *printSQL}, {"--print-grants", grantsFor != nil}, {"--export", *exportDir != ""}} {
			if m.on {
				modes = append(modes, m.name)
			}
		}
		if len(modes) > 1 {
			return usageErrorf("migrate: %s exclude each other: give one", strings.Join(modes, " and "))
		}
		schema := c.g.schema
		if grantsFor != nil {
			sql, err := migrations.Grants(schema, *grantsFor)
			if err != nil {
				return usageErrorf("migrate --print-grants: %v", err)
			}
			_, err = io.WriteString(c.stdout, sql)
			return err
		}
		if *exportDir != "" {
			paths, err := migrations.Export(*exportDir, schema)
			if err != nil {
				return c.opError(err, "migrate --export")
			}
			if c.g.json {
				return writeJSON(c.stdout, struct {
					Schema string   `json:"schema"`
					Files  []string `json:"files"`
				}{schema, paths})
			}
			for _, p := range paths {
				fmt.Fprintln(c.stdout, p)
			}
			return nil
		}
		if *printSQL {
			sql, err := migrations.Script(schema)
			if err != nil {
				return c.opError(err, "migrate --print")
			}
			if c.g.json {
				return writeJSON(c.stdout, struct {
					Schema string `json:"schema"`
					SQL    string `json:"sql"`
				}{schema, sql})
			}
			_, err = io.WriteString(c.stdout, sql)
			return err
		}

		if _, err := c.connect(ctx); err != nil {
			return err
		}
		res, err := migrations.Migrate(ctx, c.pool, schema)
		if err != nil {
			return c.opError(err, "migrate schema %q", schema)
		}
		if c.g.json {
			applied := make([]migrationJSON, 0, len(res.Applied))
			for _, m := range res.Applied {
				applied = append(applied, migrationJSON{Version: m.Version, Name: m.Name})
			}
			return writeJSON(c.stdout, struct {
				Schema  string          `json:"schema"`
				Applied []migrationJSON `json:"applied"`
				Version int             `json:"version"`
			}{schema, applied, res.Version})
		}
		if len(res.Applied) == 0 {
			fmt.Fprintf(c.stdout, "schema %q is up to date (version %d)\n", schema, res.Version)
			return nil
		}
		for _, m := range res.Applied {
			fmt.Fprintf(c.stdout, "applied %03d_%s\n", m.Version, m.Name)
		}
		fmt.Fprintf(c.stdout, "schema %q is at version %d\n", schema, res.Version)
		return nil
	}
}
