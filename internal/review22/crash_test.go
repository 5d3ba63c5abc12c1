package review22

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/relay"
)

const keys = 10

// crashWhileDraining writes rounds of rows over keys k0..k9 while the
// relays run, and crashes PostgreSQL right after each round, mid-drain.
func crashWhileDraining(t *testing.T, r *rig, rounds, perRound int) {
	t.Helper()
	seq := 0
	for round := range rounds {
		for range perRound {
			r.insert(t, msg(topicOrders, fmt.Sprintf("k%d", seq%keys), seq))
			seq++
		}
		time.Sleep(time.Duration(rand.IntN(60)) * time.Millisecond)
		r.crash(t)
		t.Logf("crash %d after %d rows", round+1, seq)
	}
	for range perRound / 2 {
		r.insert(t, msg(topicOrders, fmt.Sprintf("k%d", seq%keys), seq))
		seq++
	}
}

// TestStartedRelayLosesNothingAcrossFiveCrashes: a started relay (not
// RunOnce) drains a backlog that grows while PostgreSQL is crashed five
// times mid-drain. The relay is never restarted: it must carry on by
// itself, every row must end on the topic and marked published, and the
// first delivery of each key's messages must follow the write order (one
// relay; a PostgreSQL crash is none of the documented reorderings).
func TestStartedRelayLosesNothingAcrossFiveCrashes(t *testing.T) {
	t.Parallel()
	r := newRig(t, false)
	rl := r.started(t, nil, r.writer(t), relay.Config{BatchSize: 25})
	crashWhileDraining(t, r, 5, 120)
	r.waitSettled(t, 20*time.Second)

	h := r.healthAfterCrashes(t, rl)
	require.True(t, h.Running, "the relay's loop stopped after the crashes")
	dups := r.requireAllDelivered(t, topicOrders, nil)

	// Per key, the first copy of each message comes in write order.
	_, all := r.onTopic(t, topicOrders)
	seen := map[uuid.UUID]bool{}
	last := map[string]int{}
	for _, m := range all {
		id := uuid.MustParse(mustHeader(t, m))
		if seen[id] {
			continue
		}
		seen[id] = true
		s := seqOf(t, m.Value)
		k := string(m.Key)
		if prev, ok := last[k]; ok {
			require.Greater(t, s, prev, "key %s: message seq %d first delivered after seq %d (partition %d offset %d)", k, s, prev, m.Partition, m.Offset)
		}
		last[k] = s
	}
	t.Logf("%d rows, %d messages, %d ids delivered more than once, %d crashes; the relay counted %d marks (more than the rows: marks it committed that a crash undid)",
		len(r.written), len(all), dups, r.crashes, h.Published)
}

// TestTwoStartedRelaysLoseNothingAcrossCrashes: two started relays, each on
// a pool of its own, share one outbox while PostgreSQL crashes four times.
// Nothing may be lost and every copy carries its row's message id.
func TestTwoStartedRelaysLoseNothingAcrossCrashes(t *testing.T) {
	t.Parallel()
	r := newRig(t, false)
	var relays []*relay.Relay
	for range 2 {
		pool, err := pgxpool.New(r.ctx, r.srv.ConnString())
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		relays = append(relays, r.started(t, pool, r.writer(t), relay.Config{BatchSize: 20}))
	}
	crashWhileDraining(t, r, 3, 120)
	r.waitSettled(t, 20*time.Second)
	var published int64
	for i, rl := range relays {
		h := r.healthAfterCrashes(t, rl)
		require.True(t, h.Running, "relay %d's loop stopped after the crashes", i)
		published += h.Published
	}
	dups := r.requireAllDelivered(t, topicOrders, nil)
	t.Logf("%d rows, %d marks by the two relays, %d ids delivered more than once", len(r.written), published, dups)
}

func mustHeader(t *testing.T, m kafka.Message) string {
	t.Helper()
	id, ok := header(m, store.HeaderMessageID)
	require.True(t, ok)
	return id
}
