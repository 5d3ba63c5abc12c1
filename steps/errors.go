package steps

import "errors"

// ErrInvalidConfig wraps every configuration problem found by
// [NewParticipant].
var ErrInvalidConfig = errors.New("steps: invalid participant config")
