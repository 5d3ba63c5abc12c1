//go:build !sagaflow_faults

package fault

// Enabled reports whether this build can stop at a point.
const Enabled = false

// Hit marks a crash point; in this build it does nothing.
func Hit(string) {}

// Err reports a malformed SAGAFLOW_FAULT; in this build there is none.
func Err() error { return nil }
