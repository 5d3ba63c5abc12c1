// Command printsql prints sagaflow's migrations as one SQL script for a
// schema, for teams that apply migrations with their own tool. The operator
// CLI will offer the same as `sagaflow migrate --print`.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/migrations"
)

func main() {
	schema := flag.String("schema", store.SchemaDefault, "schema to create the tables in")
	flag.Parse()
	sql, err := migrations.Script(*schema)
	if err != nil {
		fmt.Fprintln(os.Stderr, "printsql:", err)
		os.Exit(2)
	}
	fmt.Print(sql)
}
