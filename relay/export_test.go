package relay

// SetAfterPublish installs a hook that runs after the writer returned and
// before the batch's rows are marked; an error from it aborts the cycle as a
// crash between the broker's acknowledgement and the commit would. Set it
// before the relay runs.
func SetAfterPublish(r *Relay, f func() error) { r.hooks.afterPublish = f }

// Published returns how many rows r has marked published, without the
// database query of Health.
func Published(r *Relay) int64 { return r.stats.published.Load() }

// SetAfterClaim installs a hook that runs after each claim, with the number
// of rows claimed. Set it before the relay runs.
func SetAfterClaim(r *Relay, f func(rows int)) { r.hooks.afterClaim = f }

// Listening reports whether r's LISTEN connection is in place.
func Listening(r *Relay) bool { return r.listening.Load() }
