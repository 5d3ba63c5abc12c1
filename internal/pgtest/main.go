package pgtest

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// stopTimeout bounds stopping what this process started, in Main.
const stopTimeout = time.Minute

// MainParallel is [Main] with n tests of the package run at once, unless
// -parallel is given or GOMAXPROCS is n or more: for packages whose tests
// mostly wait on PostgreSQL, a broker or the engines' polls, not on the CPU.
func MainParallel(m *testing.M, n int) {
	flag.Parse()
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	if !set && runtime.GOMAXPROCS(0) < n {
		if err := flag.Set("test.parallel", strconv.Itoa(n)); err != nil {
			panic(err)
		}
	}
	Main(m)
}

// Main runs the tests of a package and exits; call it from TestMain:
//
//	func TestMain(m *testing.M) { pgtest.Main(m) }
//
// After the tests it drops the schemas [PreparedSchema] kept for reuse and
// stops the throwaway server or container that [ConnString] started in this
// process, if any. Then, if the tests passed,
// it checks with go.uber.org/goleak that they left no goroutine running
// (goroutines that existed before the tests started are ignored) and fails
// with goleak's report on stderr if they did.
func Main(m *testing.M) {
	before := goleak.IgnoreCurrent()
	kept.startMain()
	startAdmin()
	code := m.Run()
	if err := kept.dropAll(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		if code == 0 {
			code = 1
		}
	}
	stopAdmin()
	if err := stopOwned(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		if code == 0 {
			code = 1
		}
	}
	if code == 0 {
		if err := goleak.Find(before); err != nil {
			fmt.Fprintf(os.Stderr, "pgtest: the tests passed but leaked goroutines: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// stopOwned stops the server or container that discovery started.
func stopOwned() error {
	owned.mu.Lock()
	defer owned.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), stopTimeout)
	defer cancel()
	var errs []error
	if owned.server != nil {
		errs = append(errs, owned.server.Stop(ctx))
		owned.server = nil
	}
	if owned.container != nil {
		errs = append(errs, owned.container.stop(ctx))
		owned.container = nil
	}
	return errors.Join(errs...)
}
