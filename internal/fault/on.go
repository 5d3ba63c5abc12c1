//go:build sagaflow_faults

package fault

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
)

// Enabled reports whether this build can stop at a point.
const Enabled = true

var armed struct {
	mu    sync.Mutex
	point string
	nth   int
	seen  int
	fired bool
	err   error
}

func init() {
	spec := os.Getenv(Env)
	if spec == "" {
		return
	}
	point, n, ok := strings.Cut(spec, "@")
	nth, err := strconv.Atoi(n)
	if !ok || err != nil || nth < 1 {
		armed.err = fmt.Errorf("fault: %s=%q: want <point>@<n>, n >= 1", Env, spec)
		return
	}
	known := false
	for _, p := range Points {
		known = known || p == point
	}
	if !known {
		armed.err = fmt.Errorf("fault: %s=%q: unknown point %q (known: %s)", Env, spec, point, strings.Join(Points, ", "))
		return
	}
	armed.point, armed.nth = point, nth
}

// Err reports a malformed SAGAFLOW_FAULT; a worker should refuse to start.
func Err() error { return armed.err }

// Hit stops the process at point when the point is armed and this is its
// n-th hit: it reports the point on file descriptor 3 and waits for a line
// on file descriptor 4.
func Hit(point string) {
	armed.mu.Lock()
	if armed.fired || armed.point != point {
		armed.mu.Unlock()
		return
	}
	armed.seen++
	if armed.seen < armed.nth {
		armed.mu.Unlock()
		return
	}
	armed.fired = true
	// Other goroutines reaching the point meanwhile wait here too: the
	// whole process is held at the point while the parent acts.
	defer armed.mu.Unlock()
	report := os.NewFile(3, "fault-report")
	release := os.NewFile(4, "fault-release")
	if report == nil || release == nil {
		panic("fault: " + point + " fired but file descriptors 3 and 4 are not open")
	}
	if _, err := fmt.Fprintln(report, point); err != nil {
		panic("fault: report " + point + ": " + err.Error())
	}
	if _, err := bufio.NewReader(release).ReadString('\n'); err != nil {
		panic("fault: wait for release at " + point + ": " + err.Error())
	}
}
