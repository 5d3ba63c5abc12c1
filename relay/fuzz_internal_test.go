package relay

import (
	"testing"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/internal/store"
)

// FuzzBuildMessage: any row (headers as stored jsonb, any payload) becomes
// a message or a dead reason, never a panic.
func FuzzBuildMessage(f *testing.F) {
	f.Add([]byte(`{"traceparent":"00-abc-def-01"}`), []byte(`{"a":1}`), "orders", "k")
	f.Add([]byte(`[1,2]`), []byte{}, "", "")
	f.Add([]byte(`{"x":{"nested":true}}`), []byte{0}, "bad topic!", "k")
	f.Add([]byte(`null`), []byte(`x`), "t", "")
	f.Fuzz(func(t *testing.T, headers, payload []byte, topic, key string) {
		row := &store.RelayMessage{ID: uuid.New(), Topic: topic, AggregateID: key, Type: "t", Payload: payload, Headers: headers}
		m, dead := buildMessage(row, 1<<20)
		if dead == "" && m.Topic != topic {
			t.Fatalf("message for topic %q built for %q", topic, m.Topic)
		}
	})
}
