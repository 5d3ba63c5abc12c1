package main

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/relay"
)

// Topics of the drain scenarios.
const (
	drainTopic      = "bench.relay" // what every system sends the backlog to
	warmTopic       = "bench.warm"  // each writer's first message, before the clock starts
	drainPartitions = 3
	drainType       = "order.created"
	// drainChunk is the raw writer's batch: the relay's default BatchSize.
	drainChunk = relay.BatchSizeDefault
)

// drainRow is message i of the backlog, the same for every system: the key
// and payload of relay/bench_test.go.
func drainRow(i int) (id uuid.UUID, key string, payload []byte) {
	return uuid.Must(uuid.NewV7()), fmt.Sprintf("order-%d", i%1000),
		fmt.Appendf(nil, `{"order_id":"order-%d","seq":%d,"amount_cents":%d,"currency":"EUR",`+
			`"customer":"customer-%d","items":[{"sku":"sku-%d","qty":%d}]}`, i%1000, i, 100+i%9000, i%5000, i%300, 1+i%4)
}

// runDrain measures one system moving a backlog of o.Backlog messages to
// the broker: from the moment it starts to the moment the topic holds them
// all (or o.TimeBox passes).
func runDrain(ctx context.Context, o *runOpts, s *Sample) error {
	setupStart := time.Now()
	b, err := startBroker(ctx, drainPartitions, drainTopic, warmTopic)
	if err != nil {
		return err
	}
	defer b.close()
	s.Note = "broker " + b.kind() + " in this process (its CPU counts as the process's)"
	app := "bench-" + o.System + "-" + randomSuffix()
	pool, err := connect(ctx, app, 8)
	if err != nil {
		return err
	}
	defer pool.Close()
	m := &meter{pool: pool, app: app}
	counter, err := newTopicCounter(ctx, b.addrs[0], drainTopic, drainPartitions)
	if err != nil {
		return err
	}
	defer counter.close()
	schema := "bench_" + randomSuffix()
	if err := createSchema(ctx, pool, schema); err != nil {
		return err
	}
	defer dropSchema(context.Background(), pool, schema)

	want := int64(o.Backlog)
	var start func() error // starts the system, after the fill
	var stop func()
	switch o.System {
	case sysRelay:
		start, stop, err = setupRelay(ctx, pool, schema, b, o.Backlog)
	case sysWatermill:
		start, stop, err = setupWatermill(ctx, pool, schema, b, o.Backlog)
	case sysKafkaGo:
		start, stop, err = setupKafkaGo(ctx, b, o.Backlog)
	default:
		err = fmt.Errorf("unknown system %q", o.System)
	}
	if err != nil {
		return err
	}
	defer stop()
	s.SetupSeconds = time.Since(setupStart).Seconds()

	m.start(ctx)
	if err := start(); err != nil {
		return err
	}
	n, err := counter.waitFor(ctx, want, o.TimeBox)
	m.stop(ctx, s)
	if err != nil {
		return err
	}
	s.Units = int(n)
	if n < want {
		s.Partial = true
		s.Note = joinNote(s.Note, fmt.Sprintf("time-boxed at %s: %d of %d rows drained; the rate is over that part", o.TimeBox, n, want))
	}
	setRates(s)
	return nil
}

// setupRelay fills the outbox as relay/bench_test.go does (COPY, groups of
// 10 rows 1 ms apart as many small transactions leave them, then ANALYZE)
// and returns a start that starts a relay with the default settings.
func setupRelay(ctx context.Context, pool *pgxpool.Pool, schema string, b *broker, n int) (func() error, func(), error) {
	if _, err := migrations.Migrate(ctx, pool, schema); err != nil {
		return nil, nil, err
	}
	var dbNow time.Time
	if err := pool.QueryRow(ctx, "SELECT now()").Scan(&dbNow); err != nil {
		return nil, nil, err
	}
	const txRows = 10
	txs := (n + txRows - 1) / txRows
	outbox := pgx.Identifier{schema, "outbox"}
	_, err := pool.CopyFrom(ctx, outbox,
		[]string{"id", "topic", "aggregateid", "type", "payload", "available_at", "created_at"},
		pgx.CopyFromFunc(func() func() ([]any, error) {
			i := 0
			return func() ([]any, error) {
				if i >= n {
					return nil, nil
				}
				id, key, payload := drainRow(i)
				at := dbNow.Add(-time.Duration(txs-1-i/txRows) * time.Millisecond)
				i++
				return []any{id, drainTopic, key, drainType, payload, at, at}, nil
			}
		}()))
	if err != nil {
		return nil, nil, fmt.Errorf("fill the outbox: %w", err)
	}
	if _, err := pool.Exec(ctx, "ANALYZE "+outbox.Sanitize()); err != nil {
		return nil, nil, err
	}
	w := relay.NewKafkaWriter(b.addrs, nil)
	if err := w.WriteMessages(ctx, kafka.Message{Topic: warmTopic, Key: []byte("warm-up"), Value: []byte("{}")}); err != nil {
		_ = w.Close()
		return nil, nil, fmt.Errorf("warm the writer: %w", err)
	}
	r, err := relay.New(pool, w, &relay.Config{Schema: schema, Logger: discard})
	if err != nil {
		_ = w.Close()
		return nil, nil, err
	}
	start := func() error { return r.Start(ctx) }
	stop := func() {
		sctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_ = r.StopAndCancel(sctx)
		_ = w.Close()
	}
	return start, stop, nil
}

// setupKafkaGo returns a start that sends the backlog with a writer from
// relay.NewKafkaWriter, in batches of the relay's size, one synchronous
// WriteMessages each, as relay/bench_test.go's raw side does. There is no
// database: the messages are made as they are sent.
func setupKafkaGo(ctx context.Context, b *broker, n int) (func() error, func(), error) {
	w := relay.NewKafkaWriter(b.addrs, nil)
	if err := w.WriteMessages(ctx, kafka.Message{Topic: warmTopic, Key: []byte("warm-up"), Value: []byte("{}")}); err != nil {
		_ = w.Close()
		return nil, nil, fmt.Errorf("warm the writer: %w", err)
	}
	start := func() error {
		msgs := make([]kafka.Message, 0, drainChunk)
		for i := 0; i < n; {
			msgs = msgs[:0]
			for ; i < n && len(msgs) < drainChunk; i++ {
				id, key, payload := drainRow(i)
				msgs = append(msgs, kafka.Message{Topic: drainTopic, Key: []byte(key), Value: payload, Headers: []kafka.Header{
					{Key: store.HeaderMessageID, Value: []byte(id.String())},
					{Key: store.HeaderType, Value: []byte(drainType)},
				}})
			}
			if err := w.WriteMessages(ctx, msgs...); err != nil {
				return err
			}
		}
		return nil
	}
	return start, func() { _ = w.Close() }, nil
}

// watermillForwarderTopic is the SQL topic the forwarder reads.
const watermillForwarderTopic = "bench_forwarder"

// setupWatermill fills Watermill's SQL table through its forwarder
// publisher (each message enveloped with its destination topic, as an
// application publishing in its transaction would), and returns a start
// that runs Watermill's forwarder: its PostgreSQL subscriber reading that
// table, and its Kafka publisher (Sarama, synchronous) writing to the same
// broker. Defaults everywhere except the key: the message's key goes to the
// Kafka key, as the relay does with aggregateid.
func setupWatermill(ctx context.Context, pool *pgxpool.Pool, schema string, b *broker, n int) (func() error, func(), error) {
	db := stdlib.OpenDBFromPool(pool)
	logger := watermill.NopLogger{}
	qs := pgx.Identifier{schema}.Sanitize()
	schemaAdapter := wsql.DefaultPostgreSQLSchema{
		GenerateMessagesTableName: func(topic string) string { return qs + "." + pgx.Identifier{"watermill_" + topic}.Sanitize() },
	}
	offsetsAdapter := wsql.DefaultPostgreSQLOffsetsAdapter{
		GenerateMessagesOffsetsTableName: func(topic string) string {
			return qs + "." + pgx.Identifier{"watermill_offsets_" + topic}.Sanitize()
		},
	}
	sqlPub, err := wsql.NewPublisher(db, wsql.PublisherConfig{SchemaAdapter: schemaAdapter, AutoInitializeSchema: true}, logger)
	if err != nil {
		_ = db.Close()
		return nil, nil, err
	}
	pub := forwarder.NewPublisher(sqlPub, forwarder.PublisherConfig{ForwarderTopic: watermillForwarderTopic})
	const fillChunk = 1000
	batch := make([]*message.Message, 0, fillChunk)
	for i := 0; i < n; {
		batch = batch[:0]
		for ; i < n && len(batch) < fillChunk; i++ {
			id, key, payload := drainRow(i)
			msg := message.NewMessage(id.String(), payload)
			msg.Metadata.Set(watermillKeyMetadata, key)
			msg.Metadata.Set(store.HeaderType, drainType)
			batch = append(batch, msg)
		}
		if err := pub.Publish(drainTopic, batch...); err != nil {
			_ = db.Close()
			return nil, nil, fmt.Errorf("fill watermill's table: %w", err)
		}
	}
	if _, err := pool.Exec(ctx, "ANALYZE "+schemaAdapter.MessagesTable(watermillForwarderTopic)); err != nil {
		_ = db.Close()
		return nil, nil, err
	}

	kpub, err := wkafka.NewPublisher(wkafka.PublisherConfig{
		Brokers: b.addrs,
		Marshaler: wkafka.NewWithPartitioningMarshaler(func(_ string, msg *message.Message) (string, error) {
			return msg.Metadata.Get(watermillKeyMetadata), nil
		}),
	}, logger)
	if err != nil {
		_ = db.Close()
		return nil, nil, err
	}
	if err := kpub.Publish(warmTopic, message.NewMessage(uuid.NewString(), []byte("{}"))); err != nil {
		_ = kpub.Close()
		_ = db.Close()
		return nil, nil, fmt.Errorf("warm the publisher: %w", err)
	}
	sub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{
		ConsumerGroup:    "bench",
		SchemaAdapter:    schemaAdapter,
		OffsetsAdapter:   offsetsAdapter,
		InitializeSchema: true,
	}, logger)
	if err != nil {
		_ = kpub.Close()
		_ = db.Close()
		return nil, nil, err
	}
	if err := sub.SubscribeInitialize(watermillForwarderTopic); err != nil {
		_ = kpub.Close()
		_ = db.Close()
		return nil, nil, err
	}
	fwd, err := forwarder.NewForwarder(sub, kpub, logger, forwarder.Config{ForwarderTopic: watermillForwarderTopic})
	if err != nil {
		_ = kpub.Close()
		_ = db.Close()
		return nil, nil, err
	}
	runCtx, cancel := context.WithCancel(ctx)
	runDone := make(chan struct{})
	start := func() error {
		go func() {
			defer close(runDone)
			_ = fwd.Run(runCtx)
		}()
		return nil
	}
	stop := func() {
		_ = fwd.Close()
		cancel()
		select {
		case <-runDone:
		case <-time.After(30 * time.Second):
		}
		_ = kpub.Close()
		_ = sub.Close()
		_ = db.Close()
	}
	return start, stop, nil
}

// watermillKeyMetadata carries a message's Kafka key through Watermill.
const watermillKeyMetadata = "key"
