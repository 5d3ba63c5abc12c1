package saga_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/wire"
)

// shipmentDelivered is the carrier's event on its own topic.
type shipmentDelivered struct {
	OrderID string `json:"order_id"`
}

// TestAKafkaEventCompletesAWaitingSaga: a consumer in another service maps
// the carrier's ShipmentDelivered{order_id} to the fulfilment saga of that
// order; the duplicate of the event has no effect, and an event for an
// order with no saga is recorded, not retried.
func TestAKafkaEventCompletesAWaitingSaga(t *testing.T) {
	b := setup(t, nil)
	def := saga.Define("fulfilment",
		saga.Step[fulfil]{Name: "ship", Action: act(b.schema, "ship")},
		saga.Step[fulfil]{Name: "delivered", Wait: saga.OnSignal("delivered",
			func(ctx context.Context, run *saga.StepRun, s *fulfil, ev shipmentDelivered) error {
				s.Got = append(s.Got, "delivered:"+ev.OrderID)
				return recordEffect(ctx, run, b.schema)
			})},
		saga.Step[fulfil]{Name: "close", Action: act(b.schema, "close")},
	)
	require.NoError(t, b.engine.Register(def))
	b.start(t)
	ctx := context.Background()
	st, err := saga.Start(ctx, b.engine, def, fulfil{OrderID: "o-42"}, &saga.StartOpts{BusinessKey: "o-42"})
	require.NoError(t, err)
	sagatest.Wait(t, b.engine, st.ID, waiting("signal"), waitOpts())

	const topic = "carrier.events"
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, topic))
	in, err := inbox.New(b.pool, &inbox.Config{Consumer: "carrier-events", Schema: b.schema, Logger: testLogger(t)})
	require.NoError(t, err)
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: kc.Addrs(), GroupID: "fulfilment", Topic: topic,
		StartOffset: kafka.FirstOffset, MaxWait: 50 * time.Millisecond, MinBytes: 1, MaxBytes: 1 << 20})
	t.Cleanup(func() { _ = r.Close() })
	cons, err := in.NewConsumer(r, &inbox.ConsumerConfig{Default: saga.SignalOn(b.engine, "delivered",
		func(_ inbox.Message, ev shipmentDelivered) (saga.Signal, error) {
			if ev.OrderID == "" {
				return saga.Signal{}, errors.New("the event names no order")
			}
			return saga.Signal{Saga: "fulfilment", BusinessKey: ev.OrderID}, nil
		})})
	require.NoError(t, err)
	require.NoError(t, cons.Start(ctx))
	t.Cleanup(func() { _ = cons.Stop(context.Background()) })

	cl := rawProducer(t, kc)
	event := func(id, order string) *kgo.Record {
		return &kgo.Record{Topic: topic, Key: []byte(order), Value: []byte(`{"order_id":"` + order + `"}`),
			Headers: []kgo.RecordHeader{{Key: wire.HeaderMessageID, Value: []byte(id)}}}
	}
	// The event twice (the carrier retried), an event for an order with no
	// saga, and one the route refuses.
	for _, r := range []*kgo.Record{event("evt-1", "o-42"), event("evt-1", "o-42"), event("evt-2", "o-nobody"), event("evt-3", "")} {
		produce(t, cl, r)
	}

	done := b.waitTerminal(t, st.ID)
	require.Equal(t, saga.StatusCompleted, done.Status, sagatest.Describe(done))
	var s fulfil
	require.NoError(t, done.DecodeState(&s))
	require.Equal(t, []string{"ship", "delivered:o-42", "close"}, s.Got)
	require.Equal(t, []string{"ship/forward", "delivered/forward", "close/forward"}, b.effects(t, st.ID))

	waitFor(t, 20*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM `+b.table("dead_letters")+` WHERE consumer = 'carrier-events'`) == 1
	}, "the refused event to be dead-lettered")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.table("saga_signals")+` WHERE saga_id = $1`, st.ID))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.table("saga_signals")+
		` WHERE target = 'fulfilment/o-nobody' AND status = 'rejected' AND signal_id = 'evt-2'`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM `+b.table("dead_letters")+
		` WHERE consumer = 'carrier-events' AND reason LIKE '%names no order%'`))
}
