package relay

import "errors"

// ErrInvalidConfig is returned by [New] for a configuration it refuses; the
// error names the field.
var ErrInvalidConfig = errors.New("relay: invalid config")
