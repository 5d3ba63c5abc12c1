package store

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Wake-ups after the commit. A NOTIFY inside a transaction makes PostgreSQL
// hold a database-wide lock from before that transaction's commit record
// until the record is on disk, so notifying commits never share a WAL flush
// (see docs/architecture.md). A caller that owns the transaction it runs
// code in (the inbox's Process, its consumer's batches) can carry a [Wakes]
// in the context instead: writers of outbox rows record there the channel to
// wake, and the owner notifies it after the commit, through a [Notifier].

type wakesKey struct{}

// Wakes collects the channels to notify once a transaction has committed.
type Wakes struct {
	mu       sync.Mutex
	channels map[string]string // channel → payload
}

// WithWakes returns ctx carrying a new Wakes, for code that runs in a
// transaction the caller commits.
func WithWakes(ctx context.Context) (context.Context, *Wakes) {
	w := &Wakes{}
	return context.WithValue(ctx, wakesKey{}, w), w
}

// DeferWake records, in the Wakes that ctx carries, that channel is to be
// notified with payload after the commit, and reports true; it reports false
// when ctx carries none (the writer must then notify in its transaction).
func DeferWake(ctx context.Context, channel, payload string) bool {
	w, _ := ctx.Value(wakesKey{}).(*Wakes)
	if w == nil {
		return false
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.channels == nil {
		w.channels = map[string]string{}
	}
	w.channels[channel] = payload
	return true
}

// Notify asks n to notify every channel recorded in w; nil w does nothing.
func (w *Wakes) Notify(n *Notifier) {
	if w == nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for ch, payload := range w.channels {
		n.Request(ch, payload)
	}
}

// NotifyNow sends, in one round trip on db, the notifications recorded in w;
// nil w sends nothing. What it fails to send stays recorded, for a call
// after it to send.
func (w *Wakes) NotifyNow(ctx context.Context, db interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}) error {
	if w == nil {
		return nil
	}
	w.mu.Lock()
	var channels, payloads []string
	for ch, p := range w.channels {
		channels = append(channels, ch)
		payloads = append(payloads, p)
	}
	w.channels = nil
	w.mu.Unlock()
	if len(channels) == 0 {
		return nil
	}
	if _, err := db.Exec(ctx, `SELECT pg_notify(c, p) FROM unnest($1::text[], $2::text[]) AS n(c, p)`, channels, payloads); err != nil {
		w.mu.Lock()
		if w.channels == nil {
			w.channels = map[string]string{}
		}
		for i, ch := range channels {
			if _, ok := w.channels[ch]; !ok { // a wake recorded since is newer
				w.channels[ch] = payloads[i]
			}
		}
		w.mu.Unlock()
		return fmt.Errorf("store: notify after the commit: %w", err)
	}
	return nil
}

// notifyCoalesce is how long a Notifier waits for more requests of a
// channel to answer with one notification.
const notifyCoalesce = time.Millisecond

// Notifier sends notifications in transactions of their own, one per
// channel for the requests of the last millisecond: every request is
// followed by a notification sent after it.
type Notifier struct {
	pool *pgxpool.Pool
	log  *slog.Logger

	mu      sync.Mutex
	pending map[string]bool
}

// NewNotifier returns a Notifier that sends through pool.
func NewNotifier(pool *pgxpool.Pool, log *slog.Logger) *Notifier {
	return &Notifier{pool: pool, log: log, pending: map[string]bool{}}
}

// Request schedules a notification of channel with payload, unless one is
// being prepared, which will cover this request.
func (n *Notifier) Request(channel, payload string) {
	n.mu.Lock()
	if n.pending[channel] {
		n.mu.Unlock()
		return
	}
	n.pending[channel] = true
	n.mu.Unlock()
	go func() {
		time.Sleep(notifyCoalesce)
		n.mu.Lock()
		delete(n.pending, channel)
		n.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := n.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, channel, payload); err != nil && n.log != nil {
			n.log.DebugContext(ctx, "sagaflow could not notify after a commit; the relay will poll", slog.String("channel", channel),
				slog.Any("error", err))
		}
	}()
}
