package main

import (
	"context"
	"flag"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestUsage(t *testing.T) {
	t.Parallel()

	msg := runCLI(t, nil).failed(t, exitUsage)
	require.Contains(t, msg, "no command given")
	require.Contains(t, msg, "Usage:")

	msg = runCLI(t, nil, "purge").failed(t, exitUsage)
	require.True(t, strings.HasPrefix(msg, "sagaflow: unknown command \"purge\"\n"), msg)
	require.Contains(t, msg, "Commands:")
	require.Contains(t, msg, "Exit codes:")

	out := runCLI(t, nil, "help").ok(t)
	for _, s := range []string{"migrate", "list", "show", "replay", "cancel", "signal", "outbox status", "outbox replay",
		"--database-url", "$DATABASE_URL", "$SAGAFLOW_SCHEMA", "4  the database is unreachable"} {
		require.Contains(t, out, s)
	}
	require.Equal(t, out, runCLI(t, nil, "-h").ok(t))

	out = runCLI(t, nil, "help", "list").ok(t)
	requireInOrder(t, out, "Usage: sagaflow list [flags]", "Flags:", "--created-after time", "--status statuses",
		"Global flags", "Exit codes:")
	require.Equal(t, out, runCLI(t, nil, "list", "-h").ok(t))
	require.Equal(t, out, runCLI(t, nil, "list", "--help").ok(t))

	out = runCLI(t, nil, "help", "signal").ok(t)
	requireInOrder(t, out, "Usage: sagaflow signal <id> <signal> | --saga NAME --key K <signal>", "recorded as rejected",
		"Flags:", "--id id", "--key key", "--payload JSON", "--saga name", "Exit codes:")
	require.Equal(t, out, runCLI(t, nil, "signal", "-h").ok(t))

	out = runCLI(t, nil, "help", "outbox").ok(t)
	require.Contains(t, out, "sagaflow outbox status")
	require.Equal(t, out, runCLI(t, nil, "outbox", "-h").ok(t))
	require.Contains(t, runCLI(t, nil, "help", "outbox", "replay").ok(t), "--aggregate-id id")
	require.Contains(t, runCLI(t, nil, "help", "nothing").failed(t, exitUsage), `unknown command "nothing"`)

	doc := decode[struct{ Usage string }](t, runCLI(t, nil, "--json", "help", "show"))
	require.Contains(t, doc.Usage, "Usage: sagaflow show <id>")

	// help of help, and of a dead subcommand (review27 O1).
	require.Equal(t, runCLI(t, nil, "help").ok(t), runCLI(t, nil, "help", "help").ok(t))
	require.Equal(t, runCLI(t, nil, "help", "dead").ok(t), runCLI(t, nil, "help", "dead", "list").ok(t))
	require.Contains(t, runCLI(t, nil, "help", "dead", "purge").failed(t, exitUsage), `unexpected argument "purge"`)
	require.Contains(t, runCLI(t, nil, "help", "migrate").ok(t), "--export DIR")
	require.Contains(t, runCLI(t, nil, "help", "ui").ok(t), "(default 127.0.0.1:8080)")
}

// TestMalformedUsageExitsTwoBeforeTheDatabase: what is wrong with the
// command line is bad usage (exit 2), named by its flag, and found before a
// database is needed (review27 O3, O4, O10).
func TestMalformedUsageExitsTwoBeforeTheDatabase(t *testing.T) {
	t.Parallel()
	db := map[string]string{"DATABASE_URL": "postgres://nobody@127.0.0.1:1/none"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"migrate", "--print", "--print-grants", "r"}, "--print and --print-grants exclude each other"},
		{[]string{"migrate", "--print-grants", "r", "--export", t.TempDir()}, "--print-grants and --export exclude each other"},
		{[]string{"migrate", "--print", "--export", t.TempDir()}, "--print and --export exclude each other"},
		{[]string{"list", "--name", "bad\xff"}, "list: --name is not valid UTF-8"},
		{[]string{"replay", "--bulk", "--failed-step", "\xfe"}, "replay: --failed-step is not valid UTF-8"},
		{[]string{"--schema", "s\xff", "list"}, "list: --schema is not valid UTF-8"},
		{[]string{"ui", "--listen", "nonsense"}, `--listen "nonsense" is not a host:port address`},
	} {
		msg := runCLI(t, db, tc.args...).failed(t, exitUsage)
		require.Contains(t, msg, tc.want, tc.args)
		require.NotContains(t, msg, "\xff", "the bytes are not echoed")
	}
}

func TestDatabaseErrors(t *testing.T) {
	t.Parallel()

	msg := runCLI(t, nil, "list").failed(t, exitUsage)
	require.Equal(t, "sagaflow: no database: pass --database-url or set DATABASE_URL\n", msg)

	msg = runCLI(t, nil, "--database-url", "postgres://u:secret@%zz/db", "list").failed(t, exitUsage)
	require.Contains(t, msg, "--database-url")
	require.NotContains(t, msg, "secret")

	unreachable := "postgres://postgres:secret@127.0.0.1:1/x?connect_timeout=2"
	msg = runCLI(t, nil, "--database-url", unreachable, "show", "0190b3c4-0000-7000-8000-000000000000").failed(t, exitUnreachable)
	require.Contains(t, msg, "sagaflow: database postgres@127.0.0.1:1/x is unreachable: ")
	require.NotContains(t, msg, "secret")

	r := runCLI(t, map[string]string{"DATABASE_URL": unreachable}, "--json", "outbox", "status")
	require.Equal(t, exitUnreachable, r.code)
	e := decode[jsonError](t, r)
	require.Equal(t, exitUnreachable, e.Code)
	require.Contains(t, e.Error, "unreachable")

	// Usage is checked before connecting.
	msg = runCLI(t, nil, "--database-url", unreachable, "show", "x").failed(t, exitUsage)
	require.Contains(t, msg, `"x" is not a UUID`)

	msg = runCLI(t, nil, "--timeout", "0s", "migrate", "--print").failed(t, exitUsage)
	require.Contains(t, msg, "--timeout 0s")

	msg = runCLI(t, nil, "--bogus", "list").failed(t, exitUsage)
	require.Contains(t, msg, "flag provided but not defined: -bogus")
}

func TestParseInterspersed(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args, positional []string
		reason           string
		json             bool
	}{
		{args: nil, positional: nil, reason: ""},
		{args: []string{"id"}, positional: []string{"id"}},
		{args: []string{"id", "--reason", "r"}, positional: []string{"id"}, reason: "r"},
		{args: []string{"--reason", "r", "id", "--json"}, positional: []string{"id"}, reason: "r", json: true},
		{args: []string{"a", "--json", "b"}, positional: []string{"a", "b"}, json: true},
		{args: []string{"a", "--", "--json", "b"}, positional: []string{"a", "--json", "b"}},
		{args: []string{"--", "-x"}, positional: []string{"-x"}},
	} {
		fs := newFlagSet("test")
		reason := fs.String("reason", "", "")
		js := fs.Bool("json", false, "")
		got, err := parseInterspersed(fs, tc.args)
		require.NoError(t, err, tc.args)
		require.Equal(t, tc.positional, got, tc.args)
		require.Equal(t, tc.reason, *reason, tc.args)
		require.Equal(t, tc.json, *js, tc.args)
	}
	_, err := parseInterspersed(newFlagSet("test"), []string{"a", "--nope"})
	require.ErrorContains(t, err, "-nope")
	_, err = parseInterspersed(newFlagSet("test"), []string{"-h"})
	require.ErrorIs(t, err, flag.ErrHelp)
}

func TestFormat(t *testing.T) {
	t.Parallel()
	for d, want := range map[time.Duration]string{
		0:                                   "+0s",
		512 * time.Microsecond:              "+512µs",
		12*time.Millisecond + 345678:        "+12.3ms",
		1234567 * time.Microsecond:          "+1.235s",
		2*time.Minute + 3*time.Second + 4e8: "+2m3s",
		-(1*time.Millisecond + 500*time.Microsecond): "-1.5ms",
	} {
		require.Equal(t, want, formatOffset(d), d)
	}
	require.Equal(t, "a b c", oneLine("a\tb\n  c", 10))
	require.Equal(t, "abcd…", oneLine("abcdefgh", 5))
	require.Equal(t, "boom (code)", withCode("boom", "code", 10))
	require.Equal(t, "(code)", withCode("", "code", 10))
	require.Equal(t, "2026-01-02T15:04:05.123Z",
		formatTime(time.Date(2026, 1, 2, 16, 4, 5, 123456789, time.FixedZone("CET", 3600))))
}

func TestRateLimitedCommandsGetTimeForTheirPace(t *testing.T) {
	t.Parallel()
	fs := newFlagSet("x")
	fs.Int("max", 0, "")
	fs.Float64("rate", 0, "")
	require.NoError(t, fs.Parse([]string{"--max", "350", "--rate", "10"}))
	require.Equal(t, 35*time.Second+timeoutDefault, paceOf(fs), "350 replays at 10/s need 35s")
	plain := newFlagSet("y")
	require.Zero(t, paceOf(plain), "commands without --max and --rate keep the default")
	defaults := newFlagSet("z")
	defaults.Int("max", 0, "")
	defaults.Float64("rate", 0, "")
	require.Equal(t, 10*time.Second+timeoutDefault, paceOf(defaults), "100 at 10/s by default")
}

func TestInterrupted(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // as by Ctrl-C, before the command connects
	var out, errOut strings.Builder
	code := run(ctx, []string{"--database-url", f.url, "--schema", f.Schema, "list"}, &out, &errOut,
		func(string) string { return "" })
	require.Equal(t, exitFailed, code, errOut.String())
	require.Contains(t, errOut.String(), "sagaflow: interrupted while connecting to database ")
	require.NotContains(t, errOut.String(), "unreachable")
}

// TestACleanedReasonIsNoted: a reason the engine stores changed (invalid
// UTF-8, a NUL, too long) is noted on stderr; a plain one is not (review27
// O8).
func TestACleanedReasonIsNoted(t *testing.T) {
	t.Parallel()
	id := "00000000-0000-4000-8000-000000000001"
	for _, reason := range []string{"bad \xff", "nul \x00", strings.Repeat("r", 2001)} {
		msg := runCLI(t, nil, "cancel", id, "--reason", reason).failed(t, exitUsage)
		require.Contains(t, msg, "--reason is stored cleaned", "%q", reason)
		require.Contains(t, msg, "no database")
	}
	msg := runCLI(t, nil, "pause", id, "--reason", "card processor incident").failed(t, exitUsage)
	require.NotContains(t, msg, "stored cleaned")
}
