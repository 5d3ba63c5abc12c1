// Command sagaflow is the operator CLI of sagaflow: it migrates the schema,
// lists and shows sagas with their timelines, replays and cancels them, and
// reports on and replays the outbox, all against the PostgreSQL database the
// engines share.
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
//	migrate [--print]                 apply the migrations, or print their SQL
//	list [filters]                    sagas, newest first, one page at a time
//	show <id>                         a saga: header, timeline, state
//	replay <id> [--from-step S]       resume a failed saga, or re-run an ended one from a step
//	replay --bulk [filters]           the same for every matching saga, capped and rate limited
//	cancel <id> [--reason R]          cancel a running saga
//	outbox status                     pending, dead and published messages
//	outbox replay [filters]           publish already published messages again
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
//	0  success
//	1  the operation failed: the saga is not replayable or not running, a
//	   bulk replay had errors, or the database returned an error
//	2  bad usage: unknown command or flag, a missing or malformed argument
//	   (a saga id that is not a UUID, a time that is not RFC 3339), an
//	   invalid schema name, no database URL
//	3  not found: no saga with that id
//	4  the database is unreachable: connecting or pinging failed
//
// Errors go to stderr as "sagaflow: <what>: <why>"; with --json they go to
// stdout as {"error": "<what>: <why>", "code": N}, with the same exit code.
package main
