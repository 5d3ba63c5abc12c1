package testkit

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/saga"
)

// Hybrid is what a test of remote steps in the hybrid mode stands on: an
// orchestrator's schema (Orders) and a participant's (Part), each with a
// relay, on a Kafka cluster, and the participant, whose handlers the test
// registers before [Hybrid.Serve]. Part has a table "calls" (saga_id,
// kind, id, note_len, step_key) for the handlers to record what they ran
// (see [Hybrid.Record], [Hybrid.Calls]).
type Hybrid struct {
	Cluster     *kafkatest.Cluster
	Orders      *DB
	Part        *DB
	Participant *participant.Participant
	// Tenant, when set, names the engine's CommandTopic (tenant+".commands")
	// and the participant's topic and group, so that tenants running the
	// same saga share one cluster.
	Tenant string
	// Topic is the participant's command topic, Replies the orchestrator's
	// reply topic of the saga, Group the participant's consumer group.
	Topic, Replies, Group string
}

// NewHybrid builds the rig for saga name on a cluster of its own (kc nil)
// or on kc, for tenant (or none: "").
func NewHybrid(tb testing.TB, name, tenant string, kc *kafkatest.Cluster) *Hybrid {
	tb.Helper()
	prefix, commands := name, saga.CommandTopicDefault
	if tenant != "" {
		prefix, commands = tenant, tenant+".commands"
	}
	h := &Hybrid{Tenant: tenant, Topic: prefix + ".participant", Replies: commands + "." + name + ".replies", Group: prefix + "-svc"}
	if kc == nil {
		kc = kafkatest.New(tb, kafkatest.SeedTopics(1, h.Topic, h.Replies))
	} else {
		for _, topic := range []string{h.Topic, h.Replies} {
			if err := kc.CreateTopic(topic, 1); err != nil {
				tb.Fatalf("testkit: create topic %s: %v", topic, err)
			}
		}
	}
	h.Cluster = kc
	h.Orders = NewDB(tb)
	Relay(tb, kc.Addrs(), h.Orders)
	h.Part = NewDB(tb)
	Relay(tb, kc.Addrs(), h.Part)
	if _, err := h.Part.Pool.Exec(context.Background(),
		"CREATE TABLE "+h.Part.Table("calls")+" (saga_id uuid, kind text, id text, note_len int, step_key text)"); err != nil {
		tb.Fatalf("testkit: create the participant's calls table: %v", err)
	}
	p, err := participant.New(h.Part.Pool, &participant.Config{Consumer: h.Group, Schema: h.Part.Schema, Logger: Discard,
		ReplyTopics: []string{h.Replies}})
	if err != nil {
		tb.Fatalf("testkit: participant: %v", err)
	}
	h.Participant = p
	return h
}

// Serve runs the participant's consumer on its topic until the test ends.
func (h *Hybrid) Serve(tb testing.TB) {
	tb.Helper()
	Serve(tb, h.Cluster.Addrs(), h.Participant, h.Topic, h.Group, inbox.ConsumerConfig{})
}

// Config is an engine configuration in the hybrid mode on Orders: 2
// workers, a rescuer every second, the tenant's CommandTopic.
func (h *Hybrid) Config() *saga.Config {
	cfg := h.Orders.Config()
	cfg.Workers = 2
	cfg.RescueInterval = time.Second
	cfg.Kafka = &saga.KafkaConfig{Brokers: h.Cluster.Addrs()}
	if h.Tenant != "" {
		cfg.CommandTopic = h.Tenant + ".commands"
	}
	return cfg
}

// Record writes, in a participant handler's transaction tx, that it ran
// kind for saga sagaID: the command's id and note length, and its step key.
func (h *Hybrid) Record(ctx context.Context, tx pgx.Tx, sagaID uuid.UUID, kind, id string, noteLen int, stepKey string) error {
	_, err := tx.Exec(ctx, "INSERT INTO "+h.Part.Table("calls")+" VALUES ($1, $2, $3, $4, $5)", sagaID, kind, id, noteLen, stepKey)
	return err
}

// Calls lists the kinds the participant recorded for saga sagaID, in order.
func (h *Hybrid) Calls(tb testing.TB, sagaID uuid.UUID) []string {
	tb.Helper()
	rows, err := h.Part.Pool.Query(context.Background(), "SELECT kind FROM "+h.Part.Table("calls")+" WHERE saga_id = $1 ORDER BY ctid", sagaID)
	if err != nil {
		tb.Fatalf("testkit: read the participant's calls: %v", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		tb.Fatalf("testkit: read the participant's calls: %v", err)
	}
	return out
}
