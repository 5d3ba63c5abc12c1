package testkit

import (
	"context"
	"testing"
	"time"

	"github.com/sagaflow/sagaflow/relay"
)

// Relay starts a relay on d's schema that publishes to the Kafka cluster at
// brokers, polling every 20 ms with a [Discard] logger, until the test
// ends; then it stops the relay and closes its writer, failing the test if
// either fails.
func Relay(tb testing.TB, brokers []string, d *DB) {
	tb.Helper()
	RelayPolling(tb, brokers, d, 20*time.Millisecond)
}

// RelayPolling is [Relay] with a relay that polls every poll.
func RelayPolling(tb testing.TB, brokers []string, d *DB, poll time.Duration) {
	tb.Helper()
	w := relay.NewKafkaWriter(brokers, nil)
	r, err := relay.New(d.Pool, w, &relay.Config{Schema: d.Schema, PollInterval: poll, Logger: Discard})
	if err != nil {
		tb.Fatalf("testkit: relay of %s: %v", d.Schema, err)
	}
	if err := r.Start(context.Background()); err != nil {
		tb.Fatalf("testkit: start the relay of %s: %v", d.Schema, err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := r.Stop(ctx); err != nil {
			tb.Errorf("testkit: stop the relay of %s: %v", d.Schema, err)
		}
		if err := w.Close(); err != nil {
			tb.Errorf("testkit: close the relay's writer of %s: %v", d.Schema, err)
		}
	})
}
