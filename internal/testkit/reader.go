package testkit

import (
	"context"
	"sync"

	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/saga"
)

// NewSilentReader is a saga.KafkaConfig.NewReader on whose readers nothing
// ever arrives: remote steps and branches send their commands, and no reply
// comes back. Its readers return when their context ends or they are
// closed.
func NewSilentReader(string, []string) saga.KafkaReader {
	return &silentReader{done: make(chan struct{})}
}

type silentReader struct {
	once sync.Once
	done chan struct{}
}

func (r *silentReader) FetchMessage(ctx context.Context) (kafka.Message, error) {
	select {
	case <-ctx.Done():
		return kafka.Message{}, ctx.Err()
	case <-r.done:
		return kafka.Message{}, context.Canceled
	}
}

func (r *silentReader) CommitMessages(context.Context, ...kafka.Message) error { return nil }

func (r *silentReader) Close() error {
	r.once.Do(func() { close(r.done) })
	return nil
}
