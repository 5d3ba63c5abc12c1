package testkit

import (
	"context"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/participant"
)

// Serve runs participant p's consumer on topic, in consumer group group of
// the Kafka cluster at brokers, until the test ends; then it stops the
// consumer and fails the test if it did not stop cleanly. cfg's Handlers
// are p's.
func Serve(tb testing.TB, brokers []string, p *participant.Participant, topic, group string, cfg inbox.ConsumerConfig) {
	tb.Helper()
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, GroupID: group, Topic: topic, MinBytes: 1, MaxBytes: 1 << 20,
		MaxWait: 100 * time.Millisecond, StartOffset: kafka.FirstOffset, CommitInterval: 0})
	cfg.Handlers = p.Handlers()
	c, err := p.Inbox().NewConsumer(r, &cfg)
	if err != nil {
		tb.Fatalf("testkit: consumer of %s: %v", topic, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	tb.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			tb.Errorf("testkit: consumer of %s: %v", topic, err)
		}
		if err := r.Close(); err != nil {
			tb.Errorf("testkit: close the reader of %s: %v", topic, err)
		}
	})
}

// CopyReplies copies, in d's outbox, the reply rows of step key key under
// new ids: the relay publishes them again, as a participant would have sent
// them again for a command delivered twice. It fails the test when there is
// none to copy.
func CopyReplies(tb testing.TB, d *DB, key string) {
	tb.Helper()
	tag, err := d.Pool.Exec(context.Background(), "INSERT INTO "+d.Table("outbox")+
		` (id, topic, delivery, aggregatetype, aggregateid, type, payload, headers, saga_id, step_key)
		SELECT gen_random_uuid(), topic, delivery, aggregatetype, aggregateid, type, payload, headers, saga_id, step_key
		FROM `+d.Table("outbox")+` WHERE step_key = $1 AND type = 'sagaflow.reply'`, key)
	if err != nil {
		tb.Fatalf("testkit: copy the replies of %s: %v", key, err)
	}
	if tag.RowsAffected() == 0 {
		tb.Fatalf("testkit: no reply row to copy for %s", key)
	}
}
