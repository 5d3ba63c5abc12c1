package review20_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
)

// heldRig is a Kafka-mode chain with a relay of its own (BatchSize 10,
// polling once a minute) and an engine (2 workers, BatchSize 16), in which
// saga P is paused, so that its command waits in the outbox as a relay row
// held for the pause (saga/doc.go "Pause": "the step commands of a paused
// saga wait in the outbox, due at 'infinity'"; in Kafka mode a command
// consumed for a paused saga is written back held).
type heldRig struct {
	k   *kchain
	log *testkit.Buffer
	r   *relay.Relay
	e   *saga.Engine
	p   uuid.UUID
}

func newHeldRig(t *testing.T, name string) *heldRig {
	t.Helper()
	topic := saga.CommandTopicDefault + "." + name
	kc := kafkatest.New(t, kafkatest.SeedTopics(2, topic))
	d := testkit.NewDB(t)
	w := relay.NewKafkaWriter(kc.Addrs(), nil)
	var log testkit.Buffer
	r, err := relay.New(d.Pool, w, &relay.Config{Schema: d.Schema, BatchSize: 10, PollInterval: poll,
		Logger: slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	require.NoError(t, err)
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, r.Stop(ctx))
		require.NoError(t, w.Close())
	})
	k := &kchain{chain: newChain(t, d, name), kc: kc, topic: topic}
	k.client = testkit.NewEngine(t, d.Pool, kafkaMode(d, kc, 1, 16), k.def)
	ctx := context.Background()
	p, err := saga.Start(ctx, k.client, k.def, st{ID: "P"}, nil)
	require.NoError(t, err)
	require.NoError(t, k.client.Pause(ctx, p.ID, "review20: hold it"))
	e, _ := testkit.StartEngine(t, d.Pool, kafkaMode(d, kc, 2, 16), k.def)
	testkit.WaitFor(t, wait, "P's command held in the outbox", func() bool {
		return d.Count(t, "SELECT count(*) FROM "+d.Table("outbox")+" WHERE saga_id = $1 AND available_at = 'infinity'", p.ID) >= 1
	})
	return &heldRig{k: k, log: &log, r: r, e: e, p: p.ID}
}

// copies counts the message ids on the topic published more than once.
func (h *heldRig) copies(t *testing.T) (msgs, copied int) {
	t.Helper()
	all, err := h.k.kc.ReadAll(context.Background(), h.k.topic)
	require.NoError(t, err)
	seen := map[string]int{}
	for _, m := range all {
		for _, hd := range m.Headers {
			if hd.Key == "sagaflow-message-id" {
				seen[string(hd.Value)]++
			}
		}
	}
	for _, n := range seen {
		if n > 1 {
			copied++
		}
	}
	return len(all), copied
}

// TestKafkaModeRelayAndAHeldRow: F4 and its control.
func TestKafkaModeRelayAndAHeldRow(t *testing.T) {
	t.Parallel()
	t.Run("control", relayWithoutAHeldRow)
	t.Run("F4_heldRow", relayBesideAHeldRow)
}

// The control for F4: the same rig, but P is resumed before the others
// start, so that no relay row is held. 30 sagas complete, each effect
// once, and "without crashes every row is published once" (relay/doc.go,
// Many relays): no message id twice on the topic; nothing left pending.
func relayWithoutAHeldRow(t *testing.T) {
	t.Parallel()
	h := newHeldRig(t, "r20nohold")
	ctx := context.Background()
	require.NoError(t, h.k.client.Resume(ctx, h.p, "review20: go"))
	ids := startMany(t, h.k.def, "s", 30, 6, h.k.client)
	for i, id := range append([]uuid.UUID{h.p}, ids...) {
		in := endedWithin(t, h.e, id, wait)
		require.Equal(t, saga.StatusCompleted, in.Status, "%d: %v", i, testkit.Timeline(in))
		require.Equal(t, completed, h.k.effects(t, id), "%d", i)
	}
	msgs, copied := h.copies(t)
	hl, err := h.r.Health(ctx)
	require.NoError(t, err)
	t.Logf("%d messages, %d ids published more than once; relay %+v", msgs, copied, hl)
	require.Zero(t, copied, "messages published twice without a crash")
	require.Zero(t, hl.Pending)
	require.NotContains(t, h.log.String(), "cycle failed", "the relay's log")
}

// F4 (a subtest of TestKafkaModeRelayAndAHeldRow). relay/doc.go: a cycle
// "marks the acknowledged rows published", and "without crashes every row
// is published once". While saga P is paused in Kafka mode, its command is
// a relay row held at 'infinity'. When a cycle's look ahead for the next
// due row finds only that row, it fails ("store: next due relay message:
// ERROR: cannot subtract infinite timestamps (SQLSTATE 22008)", in the
// relay's log), after the write, in the transaction that marks the batch:
// the batch's rows went to Kafka, stay pending, and are published again
// (with a growing pause between failing cycles). 30 other sagas started
// while P is paused complete with each effect once (from the copies), but
// no relay cycle may fail, no message may be published twice, and nothing
// but P's row may be left pending. Resuming P ends it.
func relayBesideAHeldRow(t *testing.T) {
	t.Parallel()
	h := newHeldRig(t, "r20hold")
	ctx := context.Background()
	ids := startMany(t, h.k.def, "s", 30, 6, h.k.client)
	for i, id := range ids {
		in := endedWithin(t, h.e, id, wait)
		require.Equal(t, saga.StatusCompleted, in.Status, "s%d: %v", i, testkit.Timeline(in))
		require.Equal(t, completed, h.k.effects(t, id), "s%d", i)
	}
	time.Sleep(2 * time.Second) // what the relay does once the sagas are done
	msgs, copied := h.copies(t)
	hl, err := h.r.Health(ctx)
	require.NoError(t, err)
	failed := strings.Count(h.log.String(), "cycle failed")
	first, _, _ := strings.Cut(h.log.String()[strings.Index(h.log.String()+"error=", "error="):], "\n")
	t.Logf("%d messages for 91 commands, %d ids published more than once; %d relay cycles failed (%s); relay %+v; engine %+v",
		msgs, copied, failed, first, hl, h.e.Stats())
	require.Zero(t, failed, "relay cycles failed: %s", first)
	require.Zero(t, copied, "messages published more than once without a crash")
	require.LessOrEqual(t, hl.Pending, int64(1), "relay rows left pending beside P's held one")
	require.NoError(t, h.k.client.Resume(ctx, h.p, "review20: go"))
	in := endedWithin(t, h.e, h.p, within)
	require.Equal(t, saga.StatusCompleted, in.Status, "P: %v", testkit.Timeline(in))
}
