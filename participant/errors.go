package participant

import "errors"

// ErrInvalidConfig wraps every configuration problem found by
// [New].
var ErrInvalidConfig = errors.New("participant: invalid config")
