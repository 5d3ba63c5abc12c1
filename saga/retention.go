package saga

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/sagaflow/sagaflow/internal/store"
)

// RetentionResult counts what one [Engine.RunRetention] deleted.
type RetentionResult struct {
	Messages  int64 // published outbox rows older than OutboxRetention
	InboxKeys int64 // processed keys older than InboxRetention
	Sagas     int64 // completed or compensated sagas (with their history) older than SagaRetention
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
		delete func(context.Context, store.DBTX, time.Duration, int) (int64, error)
		window time.Duration
	}{
		{"published messages", &res.Messages, e.st.DeletePublishedMessages, e.cfg.OutboxRetention},
		{"inbox keys", &res.InboxKeys, e.st.DeleteInboxKeys, e.cfg.InboxRetention},
		{"finished sagas", &res.Sagas, e.st.DeleteFinishedSagas, e.cfg.SagaRetention},
	}
	for _, j := range jobs {
		for {
			n, err := j.delete(ctx, e.pool, j.window, e.cfg.RetentionBatch)
			if err != nil {
				return res, fmt.Errorf("saga: retention of %s: %w", j.what, err)
			}
			*j.count += n
			if n < int64(e.cfg.RetentionBatch) {
				break
			}
		}
	}
	if res != (RetentionResult{}) {
		e.log.InfoContext(ctx, "sagaflow retention deleted old rows", slog.Int64("messages", res.Messages),
			slog.Int64("inbox_keys", res.InboxKeys), slog.Int64("sagas", res.Sagas))
	}
	return res, nil
}
