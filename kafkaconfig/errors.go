package kafkaconfig

import "errors"

// ErrInvalidConfig is matched (with errors.Is) by every error that
// [Config.Validate], [Config.Dialer], [Config.Transport] and [FromEnv] return
// for a configuration they refuse. The error names the field, or with
// FromEnv the environment variable.
var ErrInvalidConfig = errors.New("kafkaconfig: invalid config")

// configError is one refused setting. Its text is complete ("kafkaconfig:
// FIELD: problem"); it matches ErrInvalidConfig and unwraps to its cause
// (an fs error for a file that cannot be read, say), when there is one that
// is safe to show.
type configError struct {
	msg   string
	cause error
}

func (e *configError) Error() string { return e.msg }

func (e *configError) Unwrap() error { return e.cause }

func (e *configError) Is(target error) bool { return target == ErrInvalidConfig }
