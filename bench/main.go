// Command bench measures sagaflow side by side with its peers on one
// machine: River's job chain and the raw SQL of a step on the same
// PostgreSQL, Temporal's development server, and, for the relay, Watermill's
// SQL forwarder and a raw kafka-go writer on the same broker.
//
//	bench compare [flags]   run every system × scenario, interleaved, each run in a child process
//	bench run [flags]       one measured run (what compare spawns); prints one JSON sample
//	bench waits [flags]     sagas that wait (issue #13): sleepers, timer lateness, signal latency
//	bench scale [flags]     a backlog drained by 1, 2 and 4 engine processes on one schema (issue #17)
//	bench retention [flags] steps/s while retention deletes a backlog past its windows (issue #17)
//	bench plot -in F -out D draw the curves of a compare report as PNGs
//	bench markdown -in F    print a compare report's tables as Markdown
//
// See docs/benchmarks.md for what is measured and how to read it.
package main

import (
	"fmt"
	"os"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "compare":
		err = compareMain(os.Args[2:])
	case "run":
		err = runMain(os.Args[2:])
	case "waits":
		err = waitsMain(os.Args[2:])
	case "scale":
		err = scaleMain(os.Args[2:])
	case "retention":
		err = retentionMain(os.Args[2:])
	case "scale-node":
		err = scaleNodeMain(os.Args[2:])
	case "plot":
		err = plotMain(os.Args[2:])
	case "markdown":
		err = markdownMain(os.Args[2:])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, `usage:
  bench compare [-quick] [-reps N] [-systems a,b] [-scenarios a,b] [-json] [-out results.json]
  bench run -system S -scenario S [-conc N] ...   (one run; compare spawns these)
  bench waits [-reps N] [-parts sleepers,timers,signals] [-sleepers N] [-out waits.json]
  bench scale [-procs 1,2,4] [-sagas N] [-workers N] [-reps N] [-out scale.json]
  bench retention [-sagas N] [-outbox N] [-conc N] [-window D] [-out retention.json]
  bench plot -in results.json -out DIR
  bench markdown -in results.json`)
	os.Exit(2)
}
