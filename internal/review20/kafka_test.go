package review20_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/saga"
)

// kchain is a chain in Kafka mode: its topic (partitions as asked) on a
// cluster of its own, a relay polling once a minute, and a client engine,
// never started, that starts sagas.
type kchain struct {
	*chain
	kc     *kafkatest.Cluster
	topic  string
	client *saga.Engine
}

func newKchain(t *testing.T, name string, partitions int32) *kchain {
	t.Helper()
	topic := saga.CommandTopicDefault + "." + name
	kc := kafkatest.New(t, kafkatest.SeedTopics(partitions, topic))
	d := testkit.NewDB(t)
	testkit.RelayPolling(t, kc.Addrs(), d, poll)
	k := &kchain{chain: newChain(t, d, name), kc: kc, topic: topic}
	k.client = testkit.NewEngine(t, d.Pool, kafkaMode(d, kc, 1, 16), k.def)
	return k
}

// Kafka mode (AllSteps), a topic of 4 partitions, BatchSize 16, relay and
// engines polling once a minute: 60 sagas started concurrently from the
// client, on one engine of 1 worker, one of 4, and two engines of 2 workers
// in one group. The same plan as in Postgres-only mode (a retry, a handler
// that leaves the transaction aborted once, a failure for good at c). Each
// batch's sagas are read in its BEGIN's pipeline now: every saga ends as
// planned with each effect exactly once, and no command is dead-lettered.
func TestManySagasKafkaMode(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name             string
		engines, workers int
	}{{"1worker", 1, 1}, {"4workers", 1, 4}, {"twoEngines", 2, 2}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			k := newKchain(t, "r20k"+tc.name, 4)
			const n = 60
			want := k.plan("s", n)
			var es []*saga.Engine
			for range tc.engines {
				e, _ := testkit.StartEngine(t, k.db.Pool, kafkaMode(k.db, k.kc, tc.workers, 16), k.def)
				es = append(es, e)
			}
			ids := startMany(t, k.def, "s", n, 12, k.client)
			for i, id := range ids {
				in := endedWithin(t, es[0], id, wait)
				status, fx := want(i)
				require.Equal(t, status, in.Status, "s%d: %v", i, testkit.Timeline(in))
				require.Equal(t, fx, k.effects(t, id), "s%d: %v", i, testkit.Timeline(in))
				if i%10 == 3 || i%10 == 5 {
					require.GreaterOrEqual(t, testkit.Events(in, saga.EventStepFailed, "b"), 1, "s%d: %v", i, testkit.Timeline(in))
				}
			}
			require.Empty(t, doubles(t, k.fx, k.db))
			page, err := k.client.DeadLetters(context.Background(), &saga.DeadOpts{Limit: 100})
			require.NoError(t, err)
			require.Empty(t, page.Letters, "dead letters of genuine commands")
			for i, e := range es {
				s := e.Stats()
				t.Logf("engine %d: succeeded %d, failed %d, retries %d, batched %d, rerun %d, deferred %d, stale %d",
					i, s.StepsSucceeded, s.AttemptsFailed, s.Retries, s.BusBatched, s.BusBatchesRerun, s.Deferred, s.StaleDiscarded)
			}
		})
	}
}

// Kafka mode: the relay (polling once a minute) and the engine's workers
// both wait on notifications. Client C starts sagas of one step after
// quiet spells, in pairs and triples around the millisecond, and in bursts
// from six goroutines; each must end within 15 s. Its start's notification
// is the relay's only wake-up for the first command, and the engine's
// notification after each step the relay's only wake-up for the next (a
// three-step saga here: a -> b -> c, each a relay hop).
func TestKafkaModeNotificationsAroundTheQuietSpell(t *testing.T) {
	t.Parallel()
	k := newKchain(t, "r20knotify", 2)
	e, _ := testkit.StartEngine(t, k.db.Pool, kafkaMode(k.db, k.kc, 2, 16), k.def)
	ctx := context.Background()
	n := 0
	start := func() uuid.UUID {
		t.Helper()
		n++
		s, err := saga.Start(ctx, k.client, k.def, st{ID: fmt.Sprint("n", n)}, nil)
		require.NoError(t, err)
		return s.ID
	}
	ended := func(what string, ids []uuid.UUID) {
		t.Helper()
		for _, id := range ids {
			in := endedWithin(t, e, id, within)
			require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v", what, testkit.Timeline(in))
			require.Equal(t, completed, k.effects(t, id), what)
		}
	}
	// The group forms with the first saga (generous: a rebalance).
	in := endedWithin(t, e, start(), wait)
	require.Equal(t, saga.StatusCompleted, in.Status, "%v", testkit.Timeline(in))
	for _, quiet := range []time.Duration{5, 1, 40, 2, 250, 1} {
		time.Sleep(quiet * time.Millisecond)
		ended(fmt.Sprintf("a lone start after %d ms", quiet), []uuid.UUID{start()})
	}
	for _, gap := range []time.Duration{0, 300 * time.Microsecond, time.Millisecond, 1500 * time.Microsecond, 3 * time.Millisecond} {
		time.Sleep(30 * time.Millisecond)
		ids := []uuid.UUID{start()}
		for range 2 {
			time.Sleep(gap)
			ids = append(ids, start())
		}
		ended(fmt.Sprintf("3 starts %s apart", gap), ids)
	}
	for burst := range 2 {
		time.Sleep(50 * time.Millisecond)
		ids := startMany(t, k.def, fmt.Sprintf("b%d-", burst), 30, 6, k.client)
		ended(fmt.Sprintf("burst %d", burst), ids)
	}
	require.Empty(t, doubles(t, k.fx, k.db))
	t.Logf("engine: %+v", e.Stats())
}

// The hybrid mode: a (local) -> pay (remote, a participant over kfake) -> c
// (local, run at once after the reply, every tenth failing once), 40
// sagas, engine of 2 workers and BatchSize 16 polling once a minute, a
// participant that records every call. Each saga completes; a and c once
// in the orchestrator's effects, pay once at the participant.
func TestHybridManySagas(t *testing.T) {
	t.Parallel()
	const name = "r20hyb"
	h := testkit.NewHybrid(t, name, "", nil)
	fx := testkit.NewEffects(t, h.Orders)
	require.NoError(t, participant.Handle(h.Participant, name+".pay", func(ctx context.Context, tx pgx.Tx, c participant.Call[st]) (map[string]string, error) {
		return map[string]string{"ref": "p-" + c.Command.ID}, h.Record(ctx, tx, c.SagaID, "pay", c.Command.ID, len(c.Command.Note), c.Key.String())
	}))
	h.Serve(t)
	var calls testkit.Counter
	rec := func(what string) saga.StepFunc[st] {
		return func(ctx context.Context, run *saga.StepRun, s *st) error {
			if calls.Add(s.ID+"/"+what) == 1 && what == "c" && s.Seen%10 == 3 {
				return errFlaky
			}
			return fx.Record(ctx, run, what)
		}
	}
	def := saga.Define(name,
		saga.Step[st]{Name: "a", Action: rec("a"), Compensate: rec("a-undo")},
		saga.Step[st]{Name: "pay", Timeout: wait, Remote: &saga.Remote[st]{Topic: h.Topic, Type: name + ".pay",
			Command: func(_ context.Context, _ *saga.StepRun, s *st) (any, error) { return st{ID: s.ID, Note: s.Note}, nil },
			OnReply: func(_ context.Context, _ *saga.StepRun, s *st, res json.RawMessage) error {
				var v map[string]string
				if err := json.Unmarshal(res, &v); err != nil {
					return err
				}
				s.Note = v["ref"]
				return nil
			}}},
		saga.Step[st]{Name: "c", Action: rec("c"), Retry: backoff(3, 50*time.Millisecond)},
	)
	cfg := h.Config()
	cfg.PollInterval, cfg.RescueInterval, cfg.BatchSize = poll, time.Hour, 16
	cfg.Kafka.SessionTimeout = 6 * time.Second
	e, _ := testkit.StartEngine(t, h.Orders.Pool, cfg, def)
	ids := make([]uuid.UUID, 40)
	for i := range ids {
		s, err := saga.Start(context.Background(), e, def, st{ID: fmt.Sprint("h", i), Seen: i}, nil)
		require.NoError(t, err)
		ids[i] = s.ID
	}
	for i, id := range ids {
		in := endedWithin(t, e, id, wait)
		require.Equal(t, saga.StatusCompleted, in.Status, "h%d: %v", i, testkit.Timeline(in))
		require.Equal(t, map[string]int{"a": 1, "c": 1}, fx.Counts(t, id), "h%d: %v", i, testkit.Timeline(in))
		require.Equal(t, []string{"pay"}, h.Calls(t, id), "h%d", i)
		var s st
		require.NoError(t, in.DecodeState(&s))
		require.Equal(t, "p-"+fmt.Sprint("h", i), s.Note, "h%d: the reply's result in the state", i)
	}
	require.Empty(t, doubles(t, fx, h.Orders))
	t.Logf("engine: %+v", e.Stats())
}
