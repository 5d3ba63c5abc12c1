// Command sagaflow is the operator CLI of sagaflow: it migrates the schema,
// lists and shows sagas with their timelines and what they wait for, replays
// and cancels them, sends them signals, and reports on and replays the
// outbox, all against the PostgreSQL database the engines share.
//
// The CLI is a client: it creates an engine that registers no saga
// definitions and never starts it. What needs a definition (running a
// replayed step, compensating a cancelled saga) is done by the engines that
// know the saga.
//
// # Usage
//
//	sagaflow [global flags] <command> [arguments] [flags]
//
// Commands:
//
//	migrate [--print | --print-grants R | --export D]  apply the migrations, print their SQL or the run-time
//	                                  grants for role R, or export one SQL file per migration into D
//	list [filters]                    sagas, newest first, one page at a time (--waiting: those that wait)
//	show <id>                         a saga: header, wait, deadline, parent, timeline, signals, state
//	replay <id> [--from-step S]       resume a failed saga, or re-run an ended one from a step
//	replay --bulk [filters]           the same for every matching saga, capped and rate limited
//	cancel <id> [--reason R]          cancel a running saga
//	versions                          sagas counted by definition version
//	pause <id> | --type N             pause a saga, or every saga of a type: no new step starts
//	unpause <id> | --type N           lift that pause: the saga continues where it paused
//	signal <id> <name> [--payload J]  send a signal to a saga (or --saga N --key K <name>), deduplicated by --id
//	outbox status                     pending, dead and published messages, and dead letters
//	dead list [filters]               dead outbox messages, or consumers' dead letters
//	dead requeue (--id I | --all)     send dead messages or dead letters again, once their cause is fixed
//	outbox replay [filters]           publish already published messages again
//	ui [--listen A] [--allow-writes]  serve the web UI for operators (default 127.0.0.1:8080, read-only)
//	help [command]                    usage of the CLI or of a command
//
// Global flags, accepted before or after the command:
//
//	--database-url URL   PostgreSQL connection URL (default $DATABASE_URL)
//	--schema NAME        schema of sagaflow's tables (default $SAGAFLOW_SCHEMA, else sagaflow)
//	--json               one JSON document per command on stdout; errors as {"error": ..., "code": N}
//	--timeout D          limit for the whole command (default 30s)
//
// Times are RFC 3339 (2026-01-02T15:04:05Z); status lists are comma
// separated. Run `sagaflow help <command>` for a command's flags.
//
// # Exit codes
//
//	0  success, including a command that found nothing to do (a listing,
//	   a bulk or outbox replay or a dry run that matches nothing)
//	1  the operation failed: the saga is not replayable or not running, a
//	   signal was recorded as rejected (the saga has ended or is
//	   compensating), a bulk replay could not replay some saga or stopped
//	   early, the command was interrupted, or the database returned an
//	   error
//	2  bad usage: unknown command or flag, a missing or malformed argument
//	   (a saga id that is not a UUID, a time that is not RFC 3339, a flag
//	   value that is not UTF-8 (but --reason: a reason is free text, stored
//	   cleaned, with a note on stderr), a --listen that is not host:port
//	   with a port number or service name), flags
//	   that exclude each other, an invalid schema name, no database URL or
//	   one that does not parse, a bulk replay of statuses that never replay
//	   (--status completed without --from-step)
//	3  not found: no saga with that id (or name and key; a signal to it is
//	   recorded as rejected)
//	4  the database is unreachable or refused the connection (a wrong
//	   password, role or database)
//
// Errors go to stderr as "sagaflow: <what>: <why>"; with --json they go to
// stdout as {"error": "<what>: <why>", "code": N}, with the same exit code.
// A dry run that ran exits with 0, whatever it found: only a database
// error, --timeout or an interruption make it exit with 1.
//
// # Waits and signals
//
// show prints what a saga waits for and until when ("signal:picked until
// 2026-01-04T10:00:00.000Z", "timer until …", "child:<id>"), its deadline,
// its parent saga and the signals sent to it (seq, time, name, id, status,
// the step that took it, and why it was rejected); list has the same in
// its WAIT column, and list --waiting keeps the sagas that wait.
//
// signal sends a signal like [saga.Engine.Signal]. Its id (--id, else a
// new UUID, printed) deduplicates: sending the same id again reports a
// duplicate and writes nothing. --payload-file reads the payload from a
// file (or stdin, "-") instead, for one longer than a command-line argument
// holds (128 KiB on Linux). Every argument is checked before the
// database is reached: a NUL byte, invalid UTF-8, a value longer than the
// engine stores, a payload that is not one JSON document, or a saga given
// both by id and by --saga and --key is refused with exit code 2, naming
// the argument, and writes nothing.
//
// # What is printed
//
// The connection string is never printed, in any output. An error about it
// says where it came from (--database-url or $DATABASE_URL) and what is
// wrong; an error from connecting names the user, host, port and database
// and the cause. Every error message is also masked for each password the
// CLI can find in its arguments and environment, since a driver's message
// can quote one: a password with an unencoded '@' in a URL, for one, is
// partly read as the host name.
//
// Stored text (saga and step names, business keys, errors and their codes,
// history details, state) comes from handlers and messages. The human
// output writes its control characters, bidirectional overrides, line
// separators and invalid UTF-8 as Go escapes (\u001b, \u202e, \xff), so
// that it cannot move the cursor, rewrite the screen or reorder what an
// operator reads; error texts are first folded onto one line. The --json
// output escapes the same characters as JSON \u escapes and decodes to the
// stored text.
package main
