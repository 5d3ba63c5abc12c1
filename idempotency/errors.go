package idempotency

import "errors"

// ErrInvalidConfig wraps every configuration problem found by [New].
var ErrInvalidConfig = errors.New("idempotency: invalid config")
