package store

import (
	"context"
	"fmt"
)

// DeadLetter is a message a consumer could not process.
type DeadLetter struct {
	Consumer  string
	MessageID string // "" when the message had none
	Topic     string
	Partition *int
	Offset    *int64
	Key       []byte
	Value     []byte
	Headers   map[string]string
	Reason    string
}

// InsertDeadLetter stores a dead letter.
func (s *Store) InsertDeadLetter(ctx context.Context, db DBTX, d *DeadLetter) error {
	headers := d.Headers
	if headers == nil {
		headers = map[string]string{}
	}
	_, err := db.Exec(ctx, "INSERT INTO "+quoteSchema(s.schema)+`.dead_letters
		(consumer, message_id, topic, kafka_partition, kafka_offset, msg_key, msg_value, headers, reason)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`,
		d.Consumer, nullStr(d.MessageID), d.Topic, d.Partition, d.Offset, d.Key, d.Value, headers, d.Reason)
	if err != nil {
		return fmt.Errorf("store: dead-letter message %q of %s: %w", d.MessageID, d.Consumer, err)
	}
	return nil
}
