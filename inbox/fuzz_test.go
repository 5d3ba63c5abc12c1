package inbox_test

import (
	"testing"

	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/store"
)

// FuzzFromKafka: any message converts, always with an id (the header, or
// its position) and its raw headers as received, and DecodeJSON returns a value or a permanent error.
func FuzzFromKafka(f *testing.F) {
	f.Add("payments", 0, int64(41), []byte(`{"order_id":"o-1","amount":5}`), store.HeaderMessageID, []byte("m-1"))
	f.Add("", -1, int64(-1), []byte{0xff, 0xfe}, "", []byte(nil))
	f.Fuzz(func(t *testing.T, topic string, partition int, offset int64, value []byte, hk string, hv []byte) {
		msg := inbox.FromKafka(kafka.Message{Topic: topic, Partition: partition, Offset: offset, Value: value,
			Headers: []kafka.Header{{Key: hk, Value: hv}}})
		if msg.ID == "" {
			t.Fatalf("message without an id: %+v", msg)
		}
		if len(msg.RawHeaders) != 1 || string(msg.RawHeaders[0].Key) != hk || string(msg.RawHeaders[0].Value) != string(hv) {
			t.Fatalf("raw headers changed: %+v", msg.RawHeaders)
		}
		if _, err := inbox.DecodeJSON[chargeRequested](msg); err != nil && !inbox.IsPermanent(err) {
			t.Fatalf("a decode error must be permanent: %v", err)
		}
	})
}
