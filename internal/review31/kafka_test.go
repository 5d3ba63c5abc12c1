package review31_test

import (
	"context"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
)

// startRelay runs r until the test ends.
func startRelay(t *testing.T, r *relay.Relay) {
	t.Helper()
	if err := r.Start(context.Background()); err != nil {
		t.Fatalf("start relay: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_ = r.Stop(ctx)
	})
}

// kafkaModeRig is a schema with a relay to a kfake cluster and a saga
// definition whose steps (in Kafka mode) go over its command topic.
func kafkaModeRig(t *testing.T) (*pgxpool.Pool, string, *kafkatest.Cluster, *saga.Definition[order]) {
	t.Helper()
	pool, schema := db(t)
	name := "r31kst"
	topic := saga.CommandTopicDefault + "." + name
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, topic))
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	t.Cleanup(func() { _ = w.Close() })
	r, err := relay.New(pool, w, &relay.Config{Schema: schema, PollInterval: 50 * time.Millisecond, Logger: discard})
	if err != nil {
		t.Fatal(err)
	}
	startRelay(t, r)
	def := saga.Define(name, saga.Step[order]{Name: "a", Action: noop, Compensate: noop}, saga.Step[order]{Name: "b", Action: noop})
	return pool, schema, kc, def
}

// startRecovering is Engine.Start that returns a panic as an error.
func startRecovering(e *saga.Engine) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("Start panicked: %v", p)
		}
	}()
	return e.Start(context.Background())
}

// TestKafkaSessionTimeoutBelowASecondIsRefused: SessionTimeout of 1 ns,
// 1 ms and a negative one are refused by New, naming the field.
func TestKafkaSessionTimeoutBelowASecondIsRefused(t *testing.T) {
	t.Parallel()
	pool, schema := db(t)
	for _, st := range []time.Duration{1, time.Millisecond, -time.Second, math.MinInt64} {
		_, err := saga.New(pool, &saga.Config{Schema: schema, Kafka: &saga.KafkaConfig{Brokers: []string{"127.0.0.1:1"}, AllSteps: true, SessionTimeout: st}})
		if err == nil || !strings.Contains(err.Error(), "SessionTimeout") {
			t.Errorf("SessionTimeout %v: New returned %v", st, err)
		}
	}
}

// TestKafkaSessionTimeoutOfTheLongestDuration (F3): KafkaConfig.
// SessionTimeout "is how long the group coordinator waits for a silent
// engine ...; Heartbeats go every tenth of it ... the broker bounds it".
// New accepts a year and time.Duration's longest (it refuses below 1 s);
// Start must then return (an error naming the field is fine), not panic.
func TestKafkaSessionTimeoutOfTheLongestDuration(t *testing.T) {
	t.Parallel()
	for _, st := range []time.Duration{365 * 24 * time.Hour, math.MaxInt64} {
		t.Run(fmt.Sprint(st), func(t *testing.T) {
			pool, schema, kc, def := kafkaModeRig(t)
			cfg := engineCfg(schema, nil)
			cfg.Kafka = &saga.KafkaConfig{Brokers: kc.Addrs(), AllSteps: true, SessionTimeout: st}
			e, err := saga.New(pool, cfg)
			if err != nil {
				t.Logf("New refused: %v", err)
				return
			}
			if err := e.Register(def); err != nil {
				t.Fatal(err)
			}
			err = startRecovering(e)
			if err == nil {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				_ = e.Stop(ctx)
				return
			}
			if strings.Contains(err.Error(), "panicked") {
				t.Errorf("%v", err)
			}
		})
	}
}

// TestKafkaSessionTimeoutTheBrokerRefuses (F4): a SessionTimeout New
// accepts but the broker refuses (kfake's range, as Kafka's, is 6 s to
// 30 min by default: 2 s and 10 h are outside it) leaves the engine
// consuming nothing. The doc says the broker bounds the value; the
// engine should then run its sagas anyway, or not report itself ready.
func TestKafkaSessionTimeoutTheBrokerRefuses(t *testing.T) {
	t.Parallel()
	for _, st := range []time.Duration{2 * time.Second, 10 * time.Hour} {
		t.Run(fmt.Sprint(st), func(t *testing.T) {
			pool, schema, kc, def := kafkaModeRig(t)
			lg := &logs{}
			cfg := engineCfg(schema, lg.logger())
			cfg.Kafka = &saga.KafkaConfig{Brokers: kc.Addrs(), AllSteps: true, SessionTimeout: st}
			e := startEngine(t, pool, cfg, def)
			s, err := saga.Start(context.Background(), e, def, order{ID: "k"}, nil)
			if err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(10 * time.Second)
			var in *saga.Instance
			for {
				in = get(t, e, s.ID)
				if in.Status.Terminal() || time.Now().After(deadline) {
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			if in.Status == saga.StatusCompleted {
				return
			}
			if rep := e.Health(context.Background()); rep.Ready {
				all := lg.all()
				t.Errorf("after 10 s the saga is %s, the engine reports ready (%+v), logged %d records, e.g. %q", in.Status, rep.Checks, len(all), all[:min(1, len(all))])
			}
		})
	}
}

// publishFive writes 5 rows through a relay over a writer made with opts
// and returns how many were published and are on the topic; a panic of
// the relay is returned as an error.
func publishFive(t *testing.T, opts *relay.WriterOpts) (published, onTopic int, err error) {
	t.Helper()
	pool, schema := db(t)
	topic := "r31.writer"
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, topic))
	w := relay.NewKafkaWriter(kc.Addrs(), opts)
	t.Cleanup(func() { _ = w.Close() })
	insert(t, pool, schema, 5, topic)
	r, err := relay.New(pool, w, &relay.Config{Schema: schema, Logger: discard})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	err = func() (err error) {
		defer func() {
			if p := recover(); p != nil {
				err = fmt.Errorf("RunOnce panicked: %v", p)
			}
		}()
		for published < 5 && ctx.Err() == nil {
			n, _, err := r.RunOnce(ctx)
			if err != nil {
				return err
			}
			published += n
		}
		return nil
	}()
	if err != nil {
		return published, 0, err
	}
	msgs, err := kc.ReadAll(context.Background(), topic)
	return published, len(msgs), err
}

// TestKafkaWriterOptsExtremes: "A nil *WriterOpts, and every zero field,
// means the default". Negative values (not documented), ones, and the
// largest timeouts, attempts and MetadataTTL make a writer through which a
// relay publishes 5 rows to kfake.
func TestKafkaWriterOptsExtremes(t *testing.T) {
	t.Parallel()
	for name, opts := range map[string]*relay.WriterOpts{
		"negative": {BatchTimeout: -1, BatchSize: -1, BatchBytes: -1, MaxAttempts: -1, ReadTimeout: -1, WriteTimeout: -1, MetadataTTL: -1},
		"minint":   {BatchTimeout: math.MinInt64, BatchSize: math.MinInt, MaxAttempts: math.MinInt, ReadTimeout: math.MinInt64, WriteTimeout: math.MinInt64, MetadataTTL: math.MinInt64},
		"largest":  {BatchBytes: math.MaxInt32, MaxAttempts: math.MaxInt, ReadTimeout: math.MaxInt64, WriteTimeout: math.MaxInt64, MetadataTTL: math.MaxInt64},
		"ones":     {BatchTimeout: 1, BatchSize: 1, MaxAttempts: 1},
	} {
		t.Run(name, func(t *testing.T) {
			published, onTopic, err := publishFive(t, opts)
			if err != nil || published != 5 || onTopic != 5 {
				t.Errorf("published %d, %d on the topic, err %v; want 5, 5, nil", published, onTopic, err)
			}
		})
	}
}

// TestKafkaWriterBatchSizeOfIntsLargest (F2): WriterOpts.BatchSize "is the
// most messages per partition in one produce request" (no maximum named;
// NewKafkaWriter returns no error). With int's largest (a way to say "no
// limit"), the relay's write must not panic.
func TestKafkaWriterBatchSizeOfIntsLargest(t *testing.T) {
	t.Parallel()
	published, onTopic, err := publishFive(t, &relay.WriterOpts{BatchSize: math.MaxInt})
	if err != nil || published != 5 || onTopic != 5 {
		t.Errorf("published %d, %d on the topic, err %v; want 5, 5, nil", published, onTopic, err)
	}
}
