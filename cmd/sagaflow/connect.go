package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/saga"
)

// poolMaxConns is plenty for one command: a re-run reads a saga's history
// while holding its row in a transaction, so two connections at most.
const poolMaxConns = 4

// connect opens the pool, checks that the database answers, and creates
// the engine: a client that registers no definitions and is never started.
func (c *cli) connect(ctx context.Context) (*saga.Engine, error) {
	if c.engine != nil {
		return c.engine, nil
	}
	if c.g.databaseURL == "" {
		return nil, usageErrorf("no database: pass --database-url or set DATABASE_URL")
	}
	cfg, err := pgxpool.ParseConfig(c.g.databaseURL)
	if err != nil {
		// pgconn masks the password in its parse errors.
		return nil, usageErrorf("--database-url: %v", err)
	}
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "sagaflow-cli"
	}
	cfg.MaxConns = poolMaxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, &cliError{code: exitUnreachable, msg: fmt.Sprintf("connect to database %s: %v", target(cfg), err)}
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		msg := fmt.Sprintf("database %s is unreachable: %v", target(cfg), err)
		if errors.Is(err, context.DeadlineExceeded) {
			msg += fmt.Sprintf(" (no answer within --timeout %s)", c.g.timeout)
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

// target names the database of cfg for messages, without its password.
func target(cfg *pgxpool.Config) string {
	cc := cfg.ConnConfig
	return fmt.Sprintf("%s@%s/%s", cc.User, net.JoinHostPort(cc.Host, strconv.Itoa(int(cc.Port))), cc.Database)
}
