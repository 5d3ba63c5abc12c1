package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/saga"
)

// poolMaxConns is plenty for one command: a re-run reads a saga's history
// while holding its row in a transaction, so two connections at most.
const poolMaxConns = 4

// connect opens the pool, checks that the database answers, and creates
// the engine: a client that registers no definitions and is never started.
//
// No message it returns holds the connection string, and each is also
// redacted when printed (see [secrets]).
func (c *cli) connect(ctx context.Context) (*saga.Engine, error) {
	if c.engine != nil {
		return c.engine, nil
	}
	if c.g.databaseURL == "" {
		return nil, usageErrorf("no database: pass --database-url or set DATABASE_URL")
	}
	cfg, err := pgxpool.ParseConfig(c.g.databaseURL)
	if err != nil {
		return nil, usageErrorf("%s is not a valid connection string (it is not shown, as it may hold a password): %s",
			c.urlSource(), parseCause(err))
	}
	// The password may also come from PGPASSWORD or a password file.
	c.secrets.add(cfg.ConnConfig.Password)
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "sagaflow-cli"
	}
	cfg.MaxConns = poolMaxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, &cliError{code: exitUnreachable, msg: fmt.Sprintf("connect to database %s: %s", target(cfg), connectCause(err))}
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		msg := fmt.Sprintf("database %s is unreachable: %s", target(cfg), connectCause(err))
		switch {
		case pgerr.Statement(err):
			// It answered: a wrong password, role or database.
			msg = fmt.Sprintf("database %s refused the connection: %s", target(cfg), connectCause(err))
		case errors.Is(err, context.DeadlineExceeded):
			msg += fmt.Sprintf(" (no answer within --timeout %s)", c.g.timeout)
		case errors.Is(err, context.Canceled):
			// Not the database's fault: the operator pressed Ctrl-C.
			return nil, &cliError{code: exitFailed, msg: fmt.Sprintf("interrupted while connecting to database %s", target(cfg))}
		}
		return nil, &cliError{code: exitUnreachable, msg: msg}
	}
	engine, err := saga.New(pool, &saga.Config{Schema: c.g.schema, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		pool.Close()
		return nil, c.opError(err, "create engine")
	}
	c.pool, c.engine = pool, engine
	return engine, nil
}

// urlSource names where the connection string came from, for messages.
func (c *cli) urlSource() string {
	if c.g.urlFromEnv {
		return "$DATABASE_URL"
	}
	return "--database-url"
}

// parseCause is why pgx could not parse a connection string, without the
// string, which its message quotes with a best-effort redaction.
func parseCause(err error) string {
	msg := err.Error()
	var pce *pgconn.ParseConfigError
	if errors.As(err, &pce) {
		// "cannot parse `<connection string>`: <why>"
		if i := strings.LastIndex(msg, "`: "); i >= 0 {
			return msg[i+len("`: "):]
		}
		return "it cannot be parsed"
	}
	return msg
}

// connectCause is why connecting failed, on one line. pgx's
// "failed to connect to `user=… database=…`:" prefix is dropped: the
// message names the target already.
func connectCause(err error) string {
	var ce *pgconn.ConnectError
	if errors.As(err, &ce) {
		if inner := ce.Unwrap(); inner != nil {
			err = inner
		}
	}
	var lines []string
	for line := range strings.Lines(err.Error()) {
		line = strings.TrimSpace(line)
		// pgx repeats the cause of each attempt on a line of its own.
		if line != "" && !slices.ContainsFunc(lines, func(l string) bool { return strings.Contains(l, line) }) {
			lines = append(lines, line)
		}
	}
	return strings.Join(lines, "; ")
}

// target names the database of cfg for messages, without its password.
func target(cfg *pgxpool.Config) string {
	cc := cfg.ConnConfig
	return fmt.Sprintf("%s@%s/%s", cc.User, net.JoinHostPort(cc.Host, strconv.Itoa(int(cc.Port))), cc.Database)
}
