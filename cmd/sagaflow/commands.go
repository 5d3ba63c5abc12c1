package main

import (
	"context"
	"flag"
	"fmt"
	"strings"
	"text/tabwriter"
)

// runFunc runs a command with its positional arguments, once its flags are
// parsed.
type runFunc func(ctx context.Context, c *cli, args []string) error

// command is one subcommand. setup defines its flags on a fresh flag set
// and returns the function that runs it with them.
type command struct {
	name    string // "list", "outbox status"
	args    string // what follows the name in the synopsis
	summary string // one line for the command list
	about   string // the paragraph of its help
	setup   func(fs *flag.FlagSet) runFunc
}

func commands() []command {
	return []command{
		{name: "migrate", args: "[--print | --print-grants ROLE | --export DIR]", setup: setupMigrate,
			summary: "apply the schema migrations, print their SQL, or the grants of a run-time role",
			about: "Apply the migrations that --schema lacks, each in its own transaction, under an advisory lock,\n" +
				"and say which were applied. With --print, print the SQL of every migration instead, for your\n" +
				"own migration tool; with --print-grants ROLE, the GRANT statements that give ROLE what sagaflow\n" +
				"needs at run time, without DDL; with --export DIR, one SQL file per migration in DIR. These\n" +
				"three exclude each other, and none of them needs a database."},
		{name: "list", args: "[flags]", setup: setupList,
			summary: "list sagas, newest first",
			about: "List sagas, newest first, one page at a time: id, name, status, current step, direction,\n" +
				"failed attempts of that step, what it waits for and until when, creation time and last error\n" +
				"code. Filters combine with AND; --waiting keeps the sagas that wait for a timer, a signal or\n" +
				"a child saga.\n" +
				"When there are more, the next page's --cursor is printed at the end."},
		{name: "show", args: "<id>", setup: setupShow,
			summary: "show a saga: header, timeline and state",
			about: "Show a saga: its status, step and last error, what it waits for and until when, its\n" +
				"deadline and parent saga; its timeline, one line per event with the database's timestamp and\n" +
				"the offset from the saga's start; the signals sent to it; and its state."},
		{name: "replay", args: "<id> [--from-step S] [--reason R] | --bulk [flags]", setup: setupReplay,
			summary: "resume a failed saga or re-run an ended one; --bulk for many",
			about: "Without --from-step, resume a failed saga where it failed: the step (action or compensation)\n" +
				"that gave up runs again, with its attempts counted afresh. With --from-step, re-run an ended\n" +
				"saga (completed, compensated or failed) forward from that step under a new epoch.\n" +
				"An engine that knows the saga runs it: the CLI only records the replay.\n\n" +
				"With --bulk, replay every saga that matches the filters (failed ones unless --status says\n" +
				"otherwise), at most --max, at most --rate per second, and print each result. --dry-run\n" +
				"lists what would be replayed and changes nothing. Without --from-step only failed sagas\n" +
				"resume; with it only ended ones re-run; other --status values are refused (exit code 2).\n" +
				"Exit code 0 when every matched saga was replayed, when none matched, and for a dry run;\n" +
				"1 when some saga could not be replayed (each is listed) or the run stopped early."},
		{name: "cancel", args: "<id> [--reason R]", setup: setupCancel,
			summary: "cancel a running saga",
			about: "Cancel a running saga: its completed steps are compensated in reverse order. The CLI knows\n" +
				"no saga definitions, so it records a cancel request that an engine which knows the saga\n" +
				"carries out. A saga that is compensating or has ended cannot be cancelled (exit code 1)."},
		{name: "versions", args: "", setup: setupVersions,
			summary: "count sagas by definition version",
			about: "Count, for each saga name and version of its definition, the sagas that run, compensate or\n" +
				"failed on it: a version whose counts are all zero can be dropped from the engines. Moving\n" +
				"sagas to another version is done in Go (saga.MigrateSagas), which has a dry run."},
		{name: "pause", args: "<id> | --type NAME [--reason R]", setup: setupPause,
			summary: "pause a saga, or every saga of a type: no new step starts",
			about: "Pause a saga that has not ended, or with --type every saga of that name (and those started\n" +
				"while the pause lasts): a step that runs finishes, and no new step, compensation, retry, timer\n" +
				"or signal delivery starts until unpause. Pausing a paused saga changes nothing. A saga that has\n" +
				"ended cannot be paused (exit code 1)."},
		{name: "unpause", args: "<id> | --type NAME [--reason R]", setup: setupUnpause,
			summary: "lift a pause: the saga continues where it paused",
			about: "Lift the pause of a saga (set by pause, or by a step whose retries ran out and that asks to\n" +
				"pause), or with --type of every saga of that name: each held command is due when it was due\n" +
				"before, or now when that has passed; a step that paused runs again with its attempts counted\n" +
				"afresh. A saga paused on its own stays paused when its type's pause is lifted. A saga that is\n" +
				"not paused on its own, or a type that is not paused, is refused (exit code 1); unpause never\n" +
				"replays a failed saga (that is replay's)."},
		{name: "signal", args: "<id> <signal> | --saga NAME --key K <signal> [--payload JSON] [--id ID]", setup: setupSignal,
			summary: "send a signal to a saga, for a step that awaits it",
			about: "Send a signal to a saga, addressed by its id or by its name and business key: a step that\n" +
				"awaits the signal's name takes it, with its --payload, now if the saga waits for it, else\n" +
				"when it reaches such a step. A second signal with the same --id to the same saga has no\n" +
				"effect (exit code 0, reported as a duplicate). A signal to a saga that has ended or is\n" +
				"compensating is recorded as rejected (exit code 1), as is one to a saga that does not exist\n" +
				"(exit code 3). Bad input (a NUL byte, invalid UTF-8, an over-long value, a payload that is\n" +
				"not JSON) is refused (exit code 2) and writes nothing."},
		{name: "outbox status", args: "", setup: setupOutboxStatus,
			summary: "count pending, dead and published outbox messages",
			about: "Count the outbox's pending messages (and the age of the oldest), dead ones (parked with\n" +
				"their reason) and published ones still within the retention window."},
		{name: "outbox replay", args: "[flags]", setup: setupOutboxReplay,
			summary: "make published outbox messages pending again",
			about: "Make already published relay messages pending again, oldest first, at most --max, at most\n" +
				"--rate per second, so the relay publishes them once more; consumers deduplicate them by\n" +
				"message id. Only messages within the outbox retention window can be replayed. --dry-run\n" +
				"lists what would be replayed and changes nothing."},
		{name: "dead", args: deadArgs, setup: setupDead, summary: deadSummary, about: deadAbout},
		uiCommand,
	}
}

// lookupCommand finds the command that args start with and returns the
// arguments after its name.
func lookupCommand(args []string) (command, []string, error) {
	name, rest := args[0], args[1:]
	if name == "outbox" {
		if len(rest) == 0 {
			return command{}, nil, &cliError{code: exitUsage, msg: "outbox: missing subcommand (status or replay)", usage: outboxUsage()}
		}
		name, rest = "outbox "+rest[0], rest[1:]
	}
	for _, cmd := range commands() {
		if cmd.name == name {
			return cmd, rest, nil
		}
	}
	usage := mainUsage()
	if strings.HasPrefix(name, "outbox ") {
		usage = outboxUsage()
	}
	return command{}, nil, &cliError{code: exitUsage, msg: fmt.Sprintf("unknown command %q", name), usage: usage}
}

const globalFlagsUsage = `Global flags (before or after the command):
  --database-url URL   PostgreSQL connection URL (default $DATABASE_URL)
  --schema NAME        schema of sagaflow's tables (default $SAGAFLOW_SCHEMA, else sagaflow)
  --json               machine output: one JSON document on stdout; errors as {"error": ..., "code": N}
  --timeout D          limit for the whole command (default 30s)
`

const exitCodesUsage = `Exit codes:
  0  success, also when nothing matched (a listing, a replay or a dry run with nothing to do)
  1  the operation failed (not replayable, not running, a rejected signal, bulk replay errors, interrupted, a database error)
  2  bad usage (unknown command or flag, malformed id or time, a flag value that is not UTF-8 (but --reason, which
     is stored cleaned), flags that exclude each other, invalid schema, no or malformed database URL)
  3  not found (no saga with that id)
  4  the database is unreachable or refused the connection
`

// mainUsage is the CLI's help.
func mainUsage() string {
	var b strings.Builder
	b.WriteString("sagaflow is the operator CLI of sagaflow: it reads and steers the sagas in PostgreSQL.\n\n")
	b.WriteString("Usage:\n  sagaflow [global flags] <command> [arguments] [flags]\n\nCommands:\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 3, ' ', 0)
	for _, cmd := range commands() {
		fmt.Fprintf(tw, "  %s\t%s\n", cmd.name, cmd.summary)
	}
	fmt.Fprintf(tw, "  help [command]\tshow the usage of a command\n")
	tw.Flush()
	b.WriteString("\n" + globalFlagsUsage + "\n" + exitCodesUsage + "\n")
	b.WriteString("Times are RFC 3339 (2026-01-02T15:04:05Z). Run 'sagaflow help <command>' for its flags.\n")
	return b.String()
}

// outboxUsage lists the commands of the group "outbox", the only group.
func outboxUsage() string {
	const group = "outbox"
	var b strings.Builder
	fmt.Fprintf(&b, "Usage:\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 3, ' ', 0)
	for _, cmd := range commands() {
		if strings.HasPrefix(cmd.name, group+" ") {
			fmt.Fprintf(tw, "  sagaflow %s %s\t%s\n", cmd.name, cmd.args, cmd.summary)
		}
	}
	tw.Flush()
	fmt.Fprintf(&b, "\nRun 'sagaflow help %s <command>' for its flags.\n", group)
	return b.String()
}

// commandUsage is the help of one command: synopsis, description, flags,
// a pointer to the global flags, exit codes.
func commandUsage(cmd command) string {
	var b strings.Builder
	synopsis := strings.TrimSpace("sagaflow " + cmd.name + " " + cmd.args)
	fmt.Fprintf(&b, "Usage: %s\n\n%s\n", synopsis, cmd.about)
	fs := newFlagSet(cmd.name)
	cmd.setup(fs)
	var lines []string
	fs.VisitAll(func(f *flag.Flag) {
		arg, usage := flag.UnquoteUsage(f)
		if arg != "" {
			arg = " " + arg
		}
		lines = append(lines, fmt.Sprintf("  --%s%s\t%s\n", f.Name, arg, usage))
	})
	if len(lines) > 0 {
		b.WriteString("\nFlags:\n")
		tw := tabwriter.NewWriter(&b, 0, 0, 3, ' ', 0)
		for _, l := range lines {
			tw.Write([]byte(l))
		}
		tw.Flush()
	}
	b.WriteString("\n" + globalFlagsUsage + "\n" + exitCodesUsage)
	return b.String()
}
