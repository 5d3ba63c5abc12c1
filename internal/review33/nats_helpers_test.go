package review33_test

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/sagaflow/sagaflow/transport/natsbus"
)

// natsURL is the machine's nats-server with JetStream.
func natsURL() string {
	if u := os.Getenv("NATS_URL"); u != "" {
		return u
	}
	return "nats://127.0.0.1:4222"
}

// natsJS connects to the machine's server; it skips the test when none
// answers. The connection is closed when the test ends.
func natsJS(t *testing.T) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(natsURL(), nats.Timeout(3*time.Second))
	if err != nil {
		t.Skipf("no nats-server at %s: %v", natsURL(), err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

// dropStreams deletes the streams of topics when the test ends, on a
// connection of its own (the test's may have been broken).
func dropStreams(t *testing.T, topics ...string) {
	t.Helper()
	t.Cleanup(func() {
		nc, err := nats.Connect(natsURL(), nats.Timeout(3*time.Second))
		if err != nil {
			return
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for _, tp := range topics {
			if err := js.DeleteStream(ctx, natsbus.StreamName(tp)); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
				t.Logf("delete stream of %q: %v", short(tp), err)
			}
		}
	})
}

// short is s cut for a log line.
func short(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}
