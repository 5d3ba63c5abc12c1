package sagatest

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/saga"
)

// Defaults of [WaitOpts].
const (
	// WaitTimeoutDefault is how long a wait lasts before it fails the test.
	WaitTimeoutDefault = 30 * time.Second
	// WaitPollDefault is how often a wait reads the saga.
	WaitPollDefault = 10 * time.Millisecond
)

// Getter reads a saga with its timeline. *saga.Engine satisfies it, started
// or not: a test can wait on sagas that engines in other processes run.
type Getter interface {
	Get(ctx context.Context, id uuid.UUID) (*saga.Instance, error)
}

// WaitOpts are the options of [Wait] and [WaitEnded]. nil means the
// defaults.
type WaitOpts struct {
	// Timeout is how long to wait before failing the test. Defaults to
	// WaitTimeoutDefault.
	Timeout time.Duration
	// Poll is how often the saga is read. Defaults to WaitPollDefault.
	Poll time.Duration
}

// Until is what a [Wait] waits for. Make one with [Ended], [Status],
// [Step], [Event] or [Cond].
type Until struct {
	what string
	met  func(*saga.Instance) bool
}

// String says what u waits for, as a failure message puts it.
func (u Until) String() string { return u.what }

// Ended waits for the saga to end: completed, compensated or failed.
func Ended() Until {
	return Until{what: "end", met: func(in *saga.Instance) bool { return in.Status.Terminal() }}
}

// Status waits for the saga to have status s.
func Status(s saga.Status) Until {
	return Until{what: "be " + string(s), met: func(in *saga.Instance) bool { return in.Status == s }}
}

// Step waits for the saga to be running or compensating at the step named
// name (its action or its compensation is due, running, or waiting for a
// retry or a reply).
func Step(name string) Until {
	return Until{what: "reach step " + name, met: func(in *saga.Instance) bool {
		return !in.Status.Terminal() && in.Step == name
	}}
}

// Event waits for the saga's timeline to hold entry, in the form of
// [Timeline]: "step_failed:charge", "saga_compensated".
func Event(entry string) Until {
	return Until{what: "record " + entry, met: func(in *saga.Instance) bool {
		return slices.Contains(Timeline(in), entry)
	}}
}

// Cond waits for met to hold; what says what it waits for, as in "saga …
// did not <what>" ("charge the card").
func Cond(what string, met func(*saga.Instance) bool) Until {
	return Until{what: what, met: met}
}

// WaitEnded waits until saga id has ended and returns it; it is
// Wait(tb, g, id, Ended(), opts).
func WaitEnded(tb testing.TB, g Getter, id uuid.UUID, opts *WaitOpts) *saga.Instance {
	tb.Helper()
	return Wait(tb, g, id, Ended(), opts)
}

// Wait reads saga id every Poll until u holds, and returns the saga as it
// was then. It fails the test, with the saga's status and timeline, when
// Timeout passes first, when the saga cannot be read, or when the saga has
// ended without u holding (an ended saga changes only when someone resumes
// or re-runs it, which a test does before it waits).
func Wait(tb testing.TB, g Getter, id uuid.UUID, u Until, opts *WaitOpts) *saga.Instance {
	tb.Helper()
	o := WaitOpts{}
	if opts != nil {
		o = *opts
	}
	if o.Timeout <= 0 {
		o.Timeout = WaitTimeoutDefault
	}
	if o.Poll <= 0 {
		o.Poll = WaitPollDefault
	}
	if u.met == nil {
		tb.Fatalf("sagatest: wait for saga %s: the zero Until waits for nothing; use Ended, Status, Step, Event or Cond", id)
		return nil
	}
	if g == nil {
		tb.Fatalf("sagatest: wait for saga %s: the Getter is nil (pass the engine, or a client engine made by saga.New)", id)
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), o.Timeout)
	defer cancel()
	ticker := time.NewTicker(o.Poll)
	defer ticker.Stop()
	var last *saga.Instance
	for {
		in, err := g.Get(ctx, id)
		switch {
		case err == nil && in == nil:
			tb.Fatalf("sagatest: wait for saga %s: the Getter returned no saga and no error", id)
			return nil
		case err == nil && in.ID != id:
			tb.Fatalf("sagatest: wait for saga %s: the Getter returned another saga, %s (%s)", id, in.ID, in.Status)
			return nil
		case err == nil:
			last = in
			if u.met(in) {
				return in
			}
			if in.Status.Terminal() {
				tb.Fatalf("sagatest: saga %s ended %s and will not %s:\n%s", id, in.Status, u.what, Describe(in))
				return nil
			}
		case ctx.Err() == nil:
			tb.Fatalf("sagatest: wait for saga %s to %s: %v", id, u.what, err)
			return nil
		}
		select {
		case <-ctx.Done():
			if last == nil {
				tb.Fatalf("sagatest: saga %s was not read once within the wait's Timeout of %s", id, o.Timeout)
				return nil
			}
			tb.Fatalf("sagatest: saga %s did not %s within %s:\n%s", id, u.what, o.Timeout, Describe(last))
			return nil
		case <-ticker.C:
		}
	}
}

// Describe renders a saga for a failure message: its status and position,
// its last error, and its timeline with each entry's attempt, error and
// detail.
func Describe(in *saga.Instance) string {
	if in == nil {
		return "  (no saga)"
	}
	s := fmt.Sprintf("  saga %s (%s) is %s at step %s (%s, epoch %d, %d failed attempts)\n",
		in.ID, in.Name, in.Status, in.Step, in.Direction, in.Epoch, in.Attempt)
	if in.LastError != nil {
		s += fmt.Sprintf("  last error: [%s] %s (step %s)\n", in.LastError.Code, in.LastError.Message, in.LastError.Step)
	}
	s += "  timeline:\n"
	if len(in.History) == 0 {
		s += "    (empty)\n"
	}
	start := time.Time{}
	if len(in.History) > 0 {
		start = in.History[0].At
	}
	for _, ev := range in.History {
		s += fmt.Sprintf("    %+9.3fs %s", ev.At.Sub(start).Seconds(), entry(ev))
		if ev.Step != "" && ev.Direction != "" {
			s += " (" + string(ev.Direction)
			if ev.Attempt > 0 {
				s += fmt.Sprintf(", attempt %d", ev.Attempt)
			}
			s += ")"
		}
		if ev.Error != "" || ev.ErrorCode != "" {
			s += fmt.Sprintf(" error [%s] %s", ev.ErrorCode, ev.Error)
		}
		if len(ev.Detail) > 0 && string(ev.Detail) != "null" {
			s += " " + string(ev.Detail)
		}
		s += "\n"
	}
	return s
}
