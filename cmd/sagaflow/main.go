package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/saga"
)

// Exit codes; see the package documentation.
const (
	exitOK          = 0
	exitFailed      = 1
	exitUsage       = 2
	exitNotFound    = 3
	exitUnreachable = 4
)

// timeoutDefault bounds a whole command.
const timeoutDefault = 30 * time.Second

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr, os.Getenv)
	stop()
	os.Exit(code)
}

// globals are the flags every command accepts.
type globals struct {
	databaseURL string
	urlFromEnv  bool // databaseURL is $DATABASE_URL
	schema      string
	// urlSet and schemaSet: the flag was given (perhaps empty: an unset
	// shell variable), which must not fall back to the environment.
	urlSet, schemaSet bool
	json              bool
	timeout           time.Duration
}

// register defines the global flags on fs, bound to g, so that they are
// accepted before the command and after it.
func (g *globals) register(fs *flag.FlagSet) {
	fs.Var(&givenString{&g.databaseURL, &g.urlSet}, "database-url", "PostgreSQL connection `URL` (default $DATABASE_URL)")
	fs.Var(&givenString{&g.schema, &g.schemaSet}, "schema", "`name` of the schema of sagaflow's tables (default $SAGAFLOW_SCHEMA, else sagaflow)")
	fs.BoolVar(&g.json, "json", g.json, "machine output: one JSON document on stdout")
	fs.DurationVar(&g.timeout, "timeout", g.timeout, "limit for the whole `duration` of the command")
}

// resolve fills what the flags left empty from the environment and checks
// the result.
func (g *globals) resolve(getenv func(string) string) error {
	// An empty value given on purpose is most likely a variable that was
	// not set ("--schema $TENANT"): acting on the default schema or
	// $DATABASE_URL instead would act on another tenant or database.
	if g.urlSet && g.databaseURL == "" {
		return usageErrorf("--database-url is empty: give a URL, or leave the flag out to use $DATABASE_URL")
	}
	if g.schemaSet && g.schema == "" {
		return usageErrorf("--schema is empty: give a schema name, or leave the flag out for $SAGAFLOW_SCHEMA, else %s", store.SchemaDefault)
	}
	if g.databaseURL == "" {
		g.databaseURL = getenv("DATABASE_URL")
		g.urlFromEnv = g.databaseURL != ""
	}
	if g.schema == "" {
		g.schema = getenv("SAGAFLOW_SCHEMA")
	}
	if g.schema == "" {
		g.schema = store.SchemaDefault
	}
	if err := store.ValidateSchema(g.schema); err != nil {
		return usageErrorf("--schema %q: %v", g.schema, err)
	}
	if g.timeout <= 0 {
		return usageErrorf("--timeout %s: must be positive", g.timeout)
	}
	return nil
}

// cli is one invocation: its streams, flags and, once a command connects,
// its pool and engine.
type cli struct {
	stdout, stderr io.Writer
	getenv         func(string) string
	g              globals
	// secrets are masked in every error message (see [secrets]).
	secrets secrets
	pool    *pgxpool.Pool
	engine  *saga.Engine
}

// run runs the command line args (without the program name) and returns the
// exit code. main calls it with the process's streams and environment; tests
// call it in-process.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	c := &cli{stdout: stdout, stderr: stderr, getenv: getenv, g: globals{timeout: timeoutDefault}}
	// Any argument may hold a connection string, in its place or not (a
	// value given to the wrong flag is echoed by the flag's error).
	for _, a := range args {
		c.secrets.addDSN(a)
	}
	c.secrets.addDSN(getenv("DATABASE_URL"))
	c.secrets.add(getenv("PGPASSWORD"))
	c.secrets.add(os.Getenv("PGPASSWORD")) // pgx reads the process's environment
	top := newFlagSet("sagaflow")
	c.g.register(top)
	if err := top.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return c.printHelp(mainUsage())
		}
		return c.fail(&cliError{code: exitUsage, msg: err.Error(), usage: mainUsage()})
	}
	rest := top.Args()
	if len(rest) == 0 {
		return c.fail(&cliError{code: exitUsage, msg: "no command given", usage: mainUsage()})
	}
	if rest[0] == "help" {
		return c.help(rest[1:])
	}
	if rest[0] == "outbox" && len(rest) == 2 && (rest[1] == "-h" || rest[1] == "-help" || rest[1] == "--help") {
		return c.printHelp(outboxUsage())
	}
	cmd, rest, err := lookupCommand(rest)
	if err != nil {
		return c.fail(err)
	}

	fs := newFlagSet("sagaflow " + cmd.name)
	runCmd := cmd.setup(fs)
	c.g.register(fs)
	positional, err := parseInterspersed(fs, rest)
	if errors.Is(err, flag.ErrHelp) {
		return c.printHelp(commandUsage(cmd))
	}
	if err == nil {
		err = validFlags(fs, top)
	}
	if err != nil {
		return c.fail(&cliError{code: exitUsage, msg: cmd.name + ": " + err.Error(), usage: commandUsage(cmd)})
	}
	if f := fs.Lookup("reason"); f != nil && flagSet(fs, "reason") {
		if r := f.Value.String(); safetext.Text(r, saga.MaxReasonBytes) != r {
			// The engine stores it cleaned; say so rather than let the
			// operator find a different text in the timeline (review27 O8).
			fmt.Fprintf(stderr, "sagaflow: note: --reason is stored cleaned: invalid UTF-8 becomes U+FFFD, a NUL \\0, and it is cut to %d bytes\n",
				saga.MaxReasonBytes)
		}
	}
	if err := c.g.resolve(getenv); err != nil {
		return c.fail(err)
	}

	timeout := c.g.timeout
	if !flagSet(top, "timeout") && !flagSet(fs, "timeout") {
		timeout = max(timeout, paceOf(fs))
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	defer c.close()
	if err := runCmd(ctx, c, positional); err != nil {
		return c.fail(err)
	}
	return exitOK
}

// validFlags refuses a flag value that is not UTF-8 text, naming the flag
// (not its bytes): no command can store or match it, and the engine's own
// refusal would name a Go field rather than the flag. (Each command checks
// its arguments; --reason is free text, which the engine cleans.)
func validFlags(fs, top *flag.FlagSet) error {
	var err error
	check := func(f *flag.Flag) {
		// A reason is free text, stored cleaned (U+FFFD for what is not
		// UTF-8), as the engine documents.
		if err == nil && f.Name != "reason" && !utf8.ValidString(f.Value.String()) {
			err = fmt.Errorf("--%s is not valid UTF-8", f.Name)
		}
	}
	top.Visit(check)
	fs.Visit(check)
	return err
}

// help runs `sagaflow help [command]`.
func (c *cli) help(args []string) int {
	if len(args) == 0 || (len(args) == 1 && args[0] == "help") {
		return c.printHelp(mainUsage())
	}
	if args[0] == "outbox" && len(args) == 1 {
		return c.printHelp(outboxUsage())
	}
	cmd, rest, err := lookupCommand(args)
	if err != nil {
		return c.fail(err)
	}
	// `help dead list`: dead's usage covers its subcommands.
	if len(rest) > 0 && (cmd.name != "dead" || len(rest) > 1 || !slices.Contains(deadSubcommands, rest[0])) {
		return c.fail(usageErrorf("help: unexpected argument %q", rest[0]))
	}
	return c.printHelp(commandUsage(cmd))
}

// printHelp writes usage text that was asked for: to stdout, or as a JSON
// document with --json.
func (c *cli) printHelp(text string) int {
	if c.g.json {
		if err := writeJSON(c.stdout, struct {
			Usage string `json:"usage"`
		}{text}); err != nil {
			return exitFailed
		}
		return exitOK
	}
	fmt.Fprint(c.stdout, text)
	return exitOK
}

// close releases the database pool, if a command opened one.
func (c *cli) close() {
	if c.pool != nil {
		c.pool.Close()
		c.pool = nil
	}
}

// newFlagSet returns a flag set that reports errors to its caller and
// prints nothing itself.
func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs
}

// flagSet reports whether the flag named name was given on fs.
func flagSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// paceOf is how long a rate-limited command (bulk and outbox replay) needs
// for its --max items at its --rate, plus time to spare; 0 for commands
// without those flags. Without an explicit --timeout, a command gets at
// least this long.
func paceOf(fs *flag.FlagSet) time.Duration {
	mf, rf := fs.Lookup("max"), fs.Lookup("rate")
	if mf == nil || rf == nil {
		return 0
	}
	n, _ := strconv.Atoi(mf.Value.String())
	rate, _ := strconv.ParseFloat(rf.Value.String(), 64)
	if n <= 0 {
		n = saga.BulkReplayMaxDefault
	}
	if rate <= 0 {
		rate = saga.ReplayRateDefault
	}
	return time.Duration(float64(n)/rate*float64(time.Second)) + timeoutDefault
}

// givenString is a string flag that records that it was given.
type givenString struct {
	p   *string
	set *bool
}

func (v *givenString) String() string {
	if v == nil || v.p == nil {
		return ""
	}
	return *v.p
}

func (v *givenString) Set(s string) error {
	*v.p, *v.set = s, true
	return nil
}
