// Package review33_test is an outside reviewer's black-box tests of the
// transports' and the log-based relay's settings at their extremes and with
// bad names, where no earlier review went: transport/natsbus (SetupOpts,
// ReaderOpts, WriterOpts, topic and group names), transport/rabbitbus
// (Topology, ReaderOpts, WriterOpts, SetupOpts, names), relay.LogicalRelay
// (LogicalConfig, slot and publication names). Written from the
// documentation only (README.md, CHANGELOG.md, docs/*.md, go doc); the
// non-test sources of the public packages were not read.
//
// Its six findings (FINDINGS.md) are fixed; each finding's test now runs
// every time and asserts the fix.
package review33_test

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/sagaflow/sagaflow/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.MainParallel(m, 2) }

// uniq is a short random name part: tests on the shared brokers never
// collide.
func uniq(prefix string) string {
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

var discard = slog.New(slog.DiscardHandler)

// waitFor polls cond every 20 ms until it holds or d passes.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// bounded runs f in a goroutine and returns its result, a panic as an
// error, or a timeout error when f does not return within d (f then keeps
// running; the test reports it as a hang).
func bounded(d time.Duration, f func() error) (err error, hung bool) {
	done := make(chan error, 1)
	go func() {
		defer func() {
			if p := recover(); p != nil {
				done <- fmt.Errorf("PANIC: %v", p)
			}
		}()
		done <- f()
	}()
	select {
	case err := <-done:
		return err, false
	case <-time.After(d):
		return fmt.Errorf("did not return within %v", d), true
	}
}

// big is a 10 kB name of legal characters.
var big = strings.Repeat("x", 10<<10)
