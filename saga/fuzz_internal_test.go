package saga

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/store"
)

// FuzzDecodeCommand: any bytes under any type decode to a valid command or
// to an error, never a panic; a command that decodes is one the executor
// can act on.
func FuzzDecodeCommand(f *testing.F) {
	id := uuid.NewString()
	f.Add(commandType, []byte(`{"saga_id":"`+id+`","saga":"checkout","step":"charge","direction":"forward","epoch":0,"version":1}`))
	f.Add(cancelType, []byte(`{"saga_id":"`+id+`","saga":"checkout","step":"charge","direction":"compensate","epoch":2,"version":9,"reason":"x"}`))
	f.Add(commandType, []byte(`{not json`))
	f.Add("orders.created", []byte(`{}`))
	f.Add(commandType, []byte(`{"saga_id":"00000000-0000-0000-0000-000000000000"}`))
	f.Fuzz(func(t *testing.T, typ string, payload []byte) {
		cmd, err := decodeCommand(&store.Claimed{Type: typ, Payload: payload})
		if err != nil {
			return
		}
		if cmd.SagaID == uuid.Nil || cmd.Saga == "" || cmd.Step == "" || !cmd.Direction.Valid() || cmd.Version <= 0 {
			t.Fatalf("decoded an unusable command: %+v", cmd)
		}
	})
}

// FuzzClaimedFromKafka: any Kafka message converts without a panic, and the
// executor's decoding of it does not panic either.
func FuzzClaimedFromKafka(f *testing.F) {
	f.Add([]byte(`{}`), store.HeaderMessageID, []byte(uuid.NewString()), store.HeaderSagaID, []byte("not-a-uuid"))
	f.Add([]byte{0xff, 0x00}, store.HeaderType, []byte(commandType), store.HeaderStepKey, []byte("a/b/c/d"))
	f.Fuzz(func(t *testing.T, value []byte, k1 string, v1 []byte, k2 string, v2 []byte) {
		m := kafka.Message{Value: value, Time: time.Now(), Headers: []kafka.Header{{Key: k1, Value: v1}, {Key: k2, Value: v2}}}
		c := claimedFromKafka(m)
		_, _ = decodeCommand(&c)
		_, _ = steps.ParseKey(string(v1))
	})
}
