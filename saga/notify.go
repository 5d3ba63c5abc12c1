package saga

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"
)

// notifyInMax bounds the delays the engine notifies the relays for when
// they end (see [Engine.notifyIn]): a relay polls more often than that.
const notifyInMax = time.Minute

// notifyCoalesce is how long the notifier waits for more commits to announce
// with one notification.
const notifyCoalesce = time.Millisecond

// notifyTimeout bounds one notification's round trip.
const notifyTimeout = 5 * time.Second

// announce tells the workers, of this engine and of every other process on
// the schema, and the relays that publish Kafka-mode commands, that commands
// are due. It is called after the transaction that wrote them committed:
// this engine's idle workers are woken at once, and one NOTIFY, in a
// transaction of its own, covers every commit made while the one before
// was prepared (at most one a millisecond; see [notifier]).
//
// The NOTIFY is not part of the committing transaction on purpose.
// PostgreSQL serialises the commits of transactions that notify: each holds
// a database-wide lock from before its commit record until that record is
// on disk, so notifying commits cannot share a WAL flush. With a notification
// in every start and every batch, that lock was the engine's main wait under
// load. The price: a process that dies between its commit and the
// notification leaves the other processes to find its commands at their next
// poll (PollInterval); the committing worker itself goes on at once.
func (e *Engine) announce() {
	if w := e.wakeLocal.Load(); w != nil {
		(*w)()
	}
	e.notifier.request(e)
}

// wakeIn wakes one of this engine's direct workers after d, when a command
// it wrote (or deferred) for then comes due. The idle workers' own look
// ahead ([store.Store.NextDirectDue]) sees only commands that existed when
// they looked: a backoff written by a Kafka worker (which does not look at
// all) while they slept waited for PollInterval. (A command due after more
// than PollInterval is found by the next poll, before it is due.)
//
// An engine that stops with such wake-ups still to fire tells the other
// engines to look ahead again (see [Engine.Stop]).
func (e *Engine) wakeIn(d time.Duration) {
	if w := e.wakeLocal.Load(); w != nil && d > 0 && d < e.cfg.PollInterval {
		e.wakesDue.Add(1)
		time.AfterFunc(d, func() {
			e.wakesDue.Add(-1)
			(*w)()
		})
	}
}

// notifyIn notifies the engines and relays of the schema after d, when a
// relay row this engine wrote for then comes due (a Kafka command moved
// back to the outbox because its saga was busy; in Kafka mode, a retry
// after its backoff). An idle relay looks ahead only when it goes idle,
// before the row was written, and would otherwise publish it at its next
// poll (a second by default) rather than after d. (Rows due after more
// than notifyInMax are left to the relays' polls; d of 0 means none.)
func (e *Engine) notifyIn(d time.Duration) {
	if d > 0 && d <= notifyInMax {
		time.AfterFunc(d, func() { e.notifier.request(e) })
	}
}

// notifier coalesces notifications: at most one is being prepared at a
// time, and a request made while one is sent schedules another, so every
// commit is followed by a notification. The first request after a quiet
// spell is sent at once; the next waits until notifyCoalesce after it, and
// covers every request made meanwhile. (Each used to wait notifyCoalesce
// first, which put a millisecond on every hop of a Kafka-mode saga.)
type notifier struct {
	pending atomic.Bool
	// last is when the last notification was sent (UnixNano).
	last atomic.Int64
	// from marks this engine's notifications ("@" and a random tag after
	// the topic), so that its own listener can tell them from the others'.
	from string
	// sleep is time.Sleep, but in tests; it must be set.
	sleep func(time.Duration)
}

// own reports whether payload is one of this engine's notifications.
func (n *notifier) own(payload string) bool {
	return n.from != "" && strings.HasSuffix(payload, n.from)
}

func (n *notifier) request(e *Engine) {
	n.schedule(func() {
		ctx, cancel := context.WithTimeout(context.Background(), notifyTimeout)
		defer cancel()
		if err := e.st.Notify(ctx, e.pool, e.cfg.CommandTopic+n.from); err != nil {
			e.log.DebugContext(ctx, "sagaflow could not notify; workers elsewhere will poll", slog.Any("error", err))
		}
	})
}

// schedule runs send in a goroutine of its own, unless one is scheduled
// and has not begun to send yet: that one covers this request.
func (n *notifier) schedule(send func()) {
	if !n.pending.CompareAndSwap(false, true) {
		return // the one being prepared will cover this commit
	}
	go func() {
		if d := notifyCoalesce - time.Since(time.Unix(0, n.last.Load())); d > 0 {
			n.sleep(d)
		}
		n.pending.Store(false)
		n.last.Store(time.Now().UnixNano())
		send()
	}()
}
