package steps

import (
	"errors"
	"fmt"
	"time"
)

// PermanentError marks an error that retrying cannot fix. Make one with
// [Permanent].
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + errText(e.Err) }
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent reports true. Packages that must not import steps recognise a
// permanent error by this method (package inbox does).
func (e *PermanentError) Permanent() bool { return true }

// Permanent marks err as not retryable: the step fails at once. A nil err
// gives a non-nil error that still says the step failed.
func Permanent(err error) error {
	if err == nil {
		err = errors.New("step failed")
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err, or an error it wraps, was marked with
// [Permanent].
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}

// RetryAfterError asks for a retry no sooner than Delay. Make one with
// [RetryAfter]; a negative Delay is taken as none.
type RetryAfterError struct {
	Delay time.Duration
	Err   error
}

func (e *RetryAfterError) Error() string {
	return fmt.Sprintf("retry after %s: %s", e.Delay, errText(e.Err))
}
func (e *RetryAfterError) Unwrap() error { return e.Err }

// RetryAfter asks for the step to be retried no sooner than d (for example
// when a provider answered 429 with a Retry-After header). The retry still
// counts against the step's maximum attempts.
func RetryAfter(d time.Duration, err error) error {
	if err == nil {
		err = errors.New("step asked to retry")
	}
	return &RetryAfterError{Delay: max(d, 0), Err: err}
}

// CodedError carries a stable, machine-readable code with an error. Make one
// with [WithCode].
type CodedError struct {
	Code string
	Err  error
}

func (e *CodedError) Error() string { return e.Code + ": " + errText(e.Err) }
func (e *CodedError) Unwrap() error { return e.Err }

// WithCode attaches a stable code (for example "card_declined") to err. The
// code is stored with the saga's error and its history entry.
func WithCode(code string, err error) error {
	if err == nil {
		err = errors.New(code)
	}
	return &CodedError{Code: code, Err: err}
}

// Code returns the code attached by [WithCode], or "" when there is none.
func Code(err error) string {
	var c *CodedError
	if errors.As(err, &c) {
		return c.Code
	}
	return ""
}

func errText(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}
