package relay

import "errors"

// ErrInvalidConfig is returned by [New] for a configuration it refuses; the
// error names the field.
var ErrInvalidConfig = errors.New("relay: invalid config")

// PublishError lets a [Writer] that is not Kafka's say what one message's
// failure means, as an entry of kafka.WriteErrors or as the error of a
// whole write:
//
//   - Permanent: the target refused this message for good (a webhook's 410,
//     a message the broker can never take). The row is parked as dead at
//     once, with Code and the error's text.
//   - Outage: the target could not be reached or could not take writes now.
//     The row spends no attempt and waits, however long the outage lasts.
//   - NotSent: the writer did not send this message, to keep its key's
//     order, because an earlier message of the same key in the same write
//     failed. The row spends no attempt and is not parked: it is due again
//     with that earlier message (after it, in claim order), or at once when
//     that one was parked as dead. A NotSent message whose key has no other
//     failure in the write is taken as a plain failure (an attempt spent),
//     so that a writer that says it wrongly cannot make a row spin.
//   - none of these: the row spends an attempt and is retried after
//     Backoff.
//
// Wrapped errors are looked through (errors.As).
type PublishError struct {
	// Code is the dead row's code when Permanent; empty means CodeRejected.
	Code      string
	Permanent bool
	Outage    bool
	NotSent   bool
	Err       error
}

func (e *PublishError) Error() string {
	if e.Err == nil {
		return "relay: publish failed"
	}
	return e.Err.Error()
}

func (e *PublishError) Unwrap() error { return e.Err }
