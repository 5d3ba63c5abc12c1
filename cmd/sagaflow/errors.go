package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/sagaflow/sagaflow/internal/pgerr"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/saga"
)

// cliError is an error with its exit code. msg reads "<what>: <why>"; the
// "sagaflow: " prefix is added when it is printed.
type cliError struct {
	code  int
	msg   string
	usage string // printed after the message on stderr, if set
}

func (e *cliError) Error() string { return e.msg }

// usageErrorf reports bad usage (exit code 2).
func usageErrorf(format string, args ...any) error {
	return &cliError{code: exitUsage, msg: fmt.Sprintf(format, args...)}
}

// opError names the operation that returned err, picks the exit code from
// the library's sentinels and adds a hint where one helps.
func (c *cli) opError(err error, format string, args ...any) error {
	var ce *cliError
	if errors.As(err, &ce) {
		return err
	}
	what := fmt.Sprintf(format, args...)
	switch {
	case errors.Is(err, saga.ErrNotFound):
		return &cliError{code: exitNotFound, msg: fmt.Sprintf("%s: no such saga in schema %q", what, c.g.schema)}
	case errors.Is(err, store.ErrInvalidSchema), errors.Is(err, saga.ErrInvalidConfig), errors.Is(err, store.ErrMalformedCursor),
		errors.Is(err, saga.ErrInvalidInput):
		return &cliError{code: exitUsage, msg: what + ": " + err.Error()}
	}
	msg := what + ": " + trimRepeat(err.Error(), what)
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		msg += fmt.Sprintf(" (the command ran past --timeout %s)", c.g.timeout)
	case errors.Is(err, context.Canceled):
		msg += " (interrupted)"
	case pgerr.Undefined(err):
		msg += fmt.Sprintf(" (is schema %q migrated? run 'sagaflow migrate')", c.g.schema)
	}
	return &cliError{code: exitFailed, msg: msg}
}

// silentError sets the exit code of a command that has already printed
// its outcome (a bulk replay with errors).
type silentError struct{ code int }

func (e *silentError) Error() string { return fmt.Sprintf("exit code %d", e.code) }

// jsonError is the document printed for an error with --json.
type jsonError struct {
	Error string `json:"error"`
	Code  int    `json:"code"`
}

// fail prints err and returns its exit code. Errors that are not a
// *cliError yet are failed operations (exit code 1).
func (c *cli) fail(err error) int {
	var se *silentError
	if errors.As(err, &se) {
		return se.code
	}
	var ce *cliError
	if !errors.As(err, &ce) {
		ce = &cliError{code: exitFailed, msg: err.Error()}
	}
	// A message can quote anything: a password that pgx failed to mask, an
	// argument, stored data inside a library error.
	msg := c.secrets.redact(ce.msg)
	if msg == "" {
		msg = fmt.Sprintf("failed with exit code %d and no message", ce.code)
	}
	if c.g.json {
		if werr := writeJSON(c.stdout, jsonError{Error: msg, Code: ce.code}); werr == nil {
			return ce.code
		}
	}
	fmt.Fprintf(c.stderr, "sagaflow: %s\n", safetext.Escape(msg))
	if ce.usage != "" {
		io.WriteString(c.stderr, "\n"+ce.usage)
	}
	return ce.code
}

// trimRepeat drops the library's leading "saga: <op> <id>: " from msg when
// what, the CLI's own prefix, already ends with that id.
func trimRepeat(msg, what string) string {
	fields := strings.Fields(what)
	if len(fields) < 2 {
		return msg
	}
	head, rest, ok := strings.Cut(msg, " "+fields[len(fields)-1]+": ")
	if ok && strings.HasPrefix(head, "saga: ") && !strings.Contains(head[len("saga: "):], ":") {
		return rest
	}
	return msg
}
