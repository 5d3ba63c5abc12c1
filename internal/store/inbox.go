package store

import (
	"context"
	"fmt"

	"github.com/sagaflow/sagaflow/internal/safetext"
)

// DeadLetter is a message a consumer could not process. Its text fields may
// hold anything that came off the wire: [Store.InsertDeadLetter] makes them
// storable, and keeps the raw bytes of the key, the value and the headers.
type DeadLetter struct {
	Consumer  string
	MessageID string // "" when the message had none
	Topic     string
	Partition *int
	Offset    *int64
	Key       []byte
	Value     []byte
	// Headers is a readable rendering of the headers; RawHeaders, when set,
	// are the headers as received, in order, duplicates included.
	Headers    map[string]string
	RawHeaders []RawHeader
	Reason     string
}

// RawHeader is one message header as received.
type RawHeader struct {
	Key   []byte
	Value []byte
}

// Bounds of the text a dead letter stores; the raw bytes are kept whole.
const (
	deadTextLimit   = 2000
	deadReasonLimit = 4000
)

// InsertDeadLetter stores a dead letter. It cannot fail on content: every
// text field is made storable first (see package safetext). A second dead
// letter for the same consumer and Kafka position is not stored again.
func (s *Store) InsertDeadLetter(ctx context.Context, db DBTX, d *DeadLetter) error {
	headers := safetext.Headers(d.Headers, deadTextLimit)
	var raw *string
	if d.RawHeaders != nil {
		enc := EncodeRawHeaders(d.RawHeaders)
		raw = &enc
	}
	id := safetext.Text(d.MessageID, deadTextLimit)
	_, err := db.Exec(ctx, "INSERT INTO "+quoteSchema(s.schema)+`.dead_letters
		(consumer, message_id, topic, kafka_partition, kafka_offset, msg_key, msg_value, headers, raw_headers, reason)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10)
		ON CONFLICT (consumer, topic, kafka_partition, kafka_offset) WHERE kafka_offset IS NOT NULL DO NOTHING`,
		safetext.Text(d.Consumer, deadTextLimit), nullStr(id), safetext.Text(d.Topic, deadTextLimit), d.Partition, d.Offset,
		d.Key, d.Value, headers, raw, safetext.Text(d.Reason, deadReasonLimit))
	if err != nil {
		return fmt.Errorf("store: dead-letter message %q of %s: %w", id, safetext.Text(d.Consumer, deadTextLimit), err)
	}
	return nil
}
