package pgtest

import (
	"context"
	"os/exec"
)

// ParseMode exposes parseMode to the tests.
func ParseMode(value string) (string, error) {
	m, err := parseMode(value)
	return string(m), err
}

// Step is a discovery step for TestDiscover.
type Step struct {
	Mode string
	Hint string
	Run  func(ctx context.Context) (string, error)
}

// Discover exposes discover to the tests.
func Discover(ctx context.Context, m string, steps []Step) (string, error) {
	ss := make([]step, len(steps))
	for i, s := range steps {
		ss[i] = step{mode: mode(s.Mode), hint: s.Hint, run: s.Run}
	}
	return discover(ctx, mode(m), ss)
}

// Fatal wraps err so that discovery stops at it.
func Fatal(err error) error { return &fatalStepError{err} }

// FindDockerEngine exposes findDockerEngine to the tests.
var FindDockerEngine = findDockerEngine

// HelperModule exposes helperModule to the tests.
var HelperModule = helperModule

// ErrNoDockerEngine exposes errNoDockerEngine to the tests.
var ErrNoDockerEngine = errNoDockerEngine

// StartContainer exposes startContainer to the tests.
func StartContainer(ctx context.Context) (connStr string, stop func(context.Context) error, err error) {
	c, err := startContainer(ctx)
	if err != nil {
		return "", nil, err
	}
	return c.connStr, c.stop, nil
}

// OwnedServer returns the throwaway server discovery started, if any.
func OwnedServer() *Server {
	owned.mu.Lock()
	defer owned.mu.Unlock()
	return owned.server
}

// RunHelper exposes runHelper to the tests: it runs name with args and env
// as the container helper.
func RunHelper(ctx context.Context, name string, args, env []string) (connStr string, stop func(context.Context) error, err error) {
	cmd := exec.Command(name, args...)
	cmd.Env = env
	c, err := runHelper(ctx, cmd, "")
	if err != nil {
		return "", nil, err
	}
	return c.connStr, c.stop, nil
}
