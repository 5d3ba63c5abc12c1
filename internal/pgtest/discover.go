package pgtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// modeEnv is the environment variable that forces one way of finding a
// server: "url", "local", "throwaway" or "container". Unset or "auto" tries
// them in that order.
const modeEnv = "SAGAFLOW_PGTEST"

// mode is a value of [modeEnv].
type mode string

const (
	modeAuto      mode = "auto"
	modeURL       mode = "url"
	modeLocal     mode = "local"
	modeThrowaway mode = "throwaway"
	modeContainer mode = "container"
)

// allModes lists the accepted values of [modeEnv], for messages.
var allModes = []mode{modeAuto, modeURL, modeLocal, modeThrowaway, modeContainer}

// localConnString is the server tried in step 2.
const localConnString = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// parseMode parses a value of [modeEnv]. The empty string means auto; case
// and surrounding spaces are ignored.
func parseMode(value string) (mode, error) {
	v := mode(strings.ToLower(strings.TrimSpace(value)))
	if v == "" {
		return modeAuto, nil
	}
	for _, m := range allModes {
		if v == m {
			return m, nil
		}
	}
	names := make([]string, len(allModes))
	for i, m := range allModes {
		names[i] = string(m)
	}
	return "", fmt.Errorf("pgtest: %s=%q is not valid: want one of %s (or leave it unset for auto)",
		modeEnv, value, strings.Join(names, ", "))
}

// step is one way of getting a server.
type step struct {
	mode mode
	// hint says what the user can provide so that this step works.
	hint string
	// run returns a connection string, or why this step is not usable.
	run func(ctx context.Context) (string, error)
}

// fatalStepError is returned by a step whose failure must stop discovery
// instead of falling through to the next step (for example a malformed
// TEST_DATABASE_URL the user did set).
type fatalStepError struct{ err error }

func (e *fatalStepError) Error() string { return e.err.Error() }
func (e *fatalStepError) Unwrap() error { return e.err }

// defaultSteps returns the discovery steps in the order of auto mode.
func defaultSteps() []step {
	return []step{
		{
			mode: modeURL,
			hint: "set TEST_DATABASE_URL (or DATABASE_URL) to a connection string",
			run:  urlFromEnv,
		},
		{
			mode: modeLocal,
			hint: "run PostgreSQL on 127.0.0.1:5432 (user postgres, database postgres, trust auth)",
			run:  tryLocal,
		},
		{
			mode: modeThrowaway,
			hint: "install the PostgreSQL server binaries (initdb and postgres, found via pg_config --bindir, /usr/lib/postgresql/*/bin or PATH)",
			run:  tryThrowaway,
		},
		{
			mode: modeContainer,
			hint: "run a Docker engine (the helper in internal/pgtest/pgcontainer starts a postgres:15-alpine container with testcontainers)",
			run:  tryContainer,
		},
	}
}

// discover runs the steps selected by m in order and returns the first
// connection string found. When none works the error lists, for each step
// tried, what to provide and why it failed.
func discover(ctx context.Context, m mode, steps []step) (string, error) {
	var tried []string
	for _, s := range steps {
		if m != modeAuto && s.mode != m {
			continue
		}
		connStr, err := s.run(ctx)
		if err == nil {
			return connStr, nil
		}
		if fe := (*fatalStepError)(nil); errors.As(err, &fe) {
			return "", err
		}
		reason := indentReason(strings.TrimPrefix(err.Error(), "pgtest: "))
		tried = append(tried, fmt.Sprintf("  - %s\n      %s: %s", s.hint, s.mode, reason))
	}
	if len(tried) == 0 {
		return "", fmt.Errorf("pgtest: no discovery step for %s=%s", modeEnv, m)
	}
	var b strings.Builder
	if m == modeAuto {
		b.WriteString("pgtest: no PostgreSQL server for tests; provide one of:\n")
	} else {
		fmt.Fprintf(&b, "pgtest: no PostgreSQL server for tests (%s=%s); provide:\n", modeEnv, m)
	}
	b.WriteString(strings.Join(tried, "\n"))
	return "", errors.New(b.String())
}

// indentReason formats a step's error under its hint: continuation lines
// are indented, and a line that repeats the one before it is dropped.
func indentReason(msg string) string {
	var lines []string
	for _, l := range strings.Split(msg, "\n") {
		l = strings.TrimSpace(l)
		if l != "" && (len(lines) == 0 || lines[len(lines)-1] != l) {
			lines = append(lines, l)
		}
	}
	return strings.Join(lines, "\n        ")
}

// urlFromEnv is step 1: TEST_DATABASE_URL, else DATABASE_URL.
func urlFromEnv(context.Context) (string, error) {
	for _, name := range []string{"TEST_DATABASE_URL", "DATABASE_URL"} {
		v := os.Getenv(name)
		if v == "" {
			continue
		}
		if _, err := pgx.ParseConfig(v); err != nil {
			return "", &fatalStepError{fmt.Errorf("pgtest: parse %s: %w", name, err)}
		}
		return v, nil
	}
	return "", errors.New("TEST_DATABASE_URL and DATABASE_URL are not set")
}

// tryLocal is step 2: the server on 127.0.0.1:5432, if it answers within
// two seconds.
func tryLocal(ctx context.Context) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := ping(ctx, localConnString); err != nil {
		return "", err
	}
	return localConnString, nil
}

// tryThrowaway is step 3: a server started by this process.
func tryThrowaway(ctx context.Context) (string, error) {
	s, err := StartServer(ctx)
	if err != nil {
		return "", err
	}
	owned.mu.Lock()
	owned.server = s
	owned.mu.Unlock()
	return s.ConnString(), nil
}

// tryContainer is step 4: a container, if a Docker engine answers.
func tryContainer(ctx context.Context) (string, error) {
	c, err := startContainer(ctx)
	if err != nil {
		return "", err
	}
	owned.mu.Lock()
	owned.container = c
	owned.mu.Unlock()
	return c.connStr, nil
}

// ping connects to connStr and checks the server answers a query.
func ping(ctx context.Context, connStr string) error {
	conn, err := pgx.Connect(ctx, connStr)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return conn.Ping(ctx)
}

// discovery caches the result of discover for the test binary.
var discovery struct {
	once    sync.Once
	connStr string
	err     error
	how     string
}

// owned holds what this process started and [Main] must stop.
var owned struct {
	mu        sync.Mutex
	server    *Server
	container *container
}

// discoveryTimeout bounds the whole discovery: the container step's build
// of its helper and its start of the container included.
const discoveryTimeout = 10 * time.Minute

// ConnString returns a connection string for a PostgreSQL server usable by
// tests, finding or starting one the first time it is called in the test
// binary (see the package documentation for the order). It calls tb.Fatal
// with a message saying what to provide when no server is available.
//
// A server or container started here is stopped by [Main]. Without Main, a
// throwaway server still dies with the test process, and a later
// [StartServer] removes its directory.
func ConnString(tb testing.TB) string {
	tb.Helper()
	ran := false
	discovery.once.Do(func() {
		ran = true
		start := time.Now()
		m, err := parseMode(os.Getenv(modeEnv))
		if err != nil {
			discovery.err = err
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), discoveryTimeout)
		defer cancel()
		discovery.connStr, discovery.err = discover(ctx, m, defaultSteps())
		discovery.how = fmt.Sprintf("%s=%s, found in %v", modeEnv, m, time.Since(start).Round(time.Millisecond))
	})
	if discovery.err != nil {
		tb.Fatal(discovery.err)
	}
	if ran {
		tb.Logf("pgtest: using %s (%s)", redact(discovery.connStr), discovery.how)
	}
	return discovery.connStr
}

// redact hides the password of a connection string for logging.
func redact(connStr string) string {
	cfg, err := pgx.ParseConfig(connStr)
	if err != nil {
		return "an unparsable connection string"
	}
	return fmt.Sprintf("postgres://%s@%s:%d/%s", cfg.User, cfg.Host, cfg.Port, cfg.Database)
}
