package saga

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/sagaflow/sagaflow/internal/store"
)

// RetentionResult counts what one [Engine.RunRetention] deleted.
type RetentionResult struct {
	Messages  int64 // published outbox rows older than OutboxRetention
	InboxKeys int64 // processed keys older than InboxRetention
	Sagas     int64 // completed or compensated sagas (with their history and signals) older than SagaRetention
	Signals   int64 // signals that matched no saga, older than SagaRetention
}

// RunRetention deletes, now, what is past its retention window, in
// statements of at most RetentionBatch rows each, until nothing is left or
// ctx ends. The scheduler runs it every RetentionInterval.
func (e *Engine) RunRetention(ctx context.Context) (RetentionResult, error) {
	var res RetentionResult
	if err := e.ready("Engine.RunRetention"); err != nil {
		return res, err
	}
	jobs := []struct {
		what   string
		count  *int64
		delete func(limit int) (int64, error)
	}{
		{"published messages", &res.Messages, func(limit int) (int64, error) {
			return e.outbox.DeletePublished(ctx, e.cfg.OutboxRetention, limit)
		}},
		{"inbox keys", &res.InboxKeys, func(limit int) (int64, error) {
			// Every consumer's keys: each inbox consumer also deletes its own.
			return e.st.DeleteInboxKeys(ctx, e.pool, "", e.cfg.InboxRetention, limit)
		}},
		{"finished sagas", &res.Sagas, func(limit int) (int64, error) {
			return e.st.DeleteFinishedSagas(ctx, e.pool, e.cfg.SagaRetention, limit)
		}},
		{"signals for no saga", &res.Signals, func(limit int) (int64, error) {
			return e.st.DeleteOrphanSignals(ctx, e.pool, e.cfg.SagaRetention, limit)
		}},
	}
	for _, j := range jobs {
		n, err := store.DeleteInBatches(e.cfg.RetentionBatch, j.delete)
		*j.count += n
		if err != nil {
			return res, fmt.Errorf("saga: retention of %s: %w", j.what, err)
		}
	}
	if res != (RetentionResult{}) {
		e.log.InfoContext(ctx, "sagaflow retention deleted old rows", slog.Int64("messages", res.Messages),
			slog.Int64("inbox_keys", res.InboxKeys), slog.Int64("sagas", res.Sagas), slog.Int64("signals", res.Signals))
	}
	return res, nil
}
