package review22

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/relay"
)

// TestDeadRowsStayDeadAcrossCrashes: rows the relay must park (too large,
// an illegal topic name, headers that are not an object of strings, a topic
// that does not exist and so spends MaxAttempts) sit among good rows while
// PostgreSQL crashes three times. A crash may undo a 'dead' mark; the row
// must then be parked again, never published, and end dead with its code;
// every good row ends on the topic.
func TestDeadRowsStayDeadAcrossCrashes(t *testing.T) {
	t.Parallel()
	r := newRig(t, false)
	r.started(t, nil, r.writer(t), relay.Config{BatchSize: 10, MaxMessageBytes: 4096, MaxAttempts: 3,
		Backoff: func(int) time.Duration { return 20 * time.Millisecond }})
	want := map[uuid.UUID]string{}
	seq := 0
	for round := range 3 {
		for i := range 40 {
			key := fmt.Sprintf("k%d", i%4)
			switch i % 10 {
			case 3:
				m := msg(topicOrders, key, seq)
				m.Payload = bytes.Repeat([]byte("x"), 10_000)
				want[r.insert(t, m)[0]] = relay.CodeTooLarge
			case 5:
				want[r.insert(t, msg("bad topic!", key, seq))[0]] = relay.CodeInvalidTopic
			case 7:
				id := uuid.Must(uuid.NewV7())
				_, err := r.pool.Exec(r.ctx, `INSERT INTO sagaflow.outbox (id, topic, aggregateid, type, payload, headers)
					VALUES ($1, $2, $3, 'test.event', '\x00', '{"n": 1}')`, id, topicOrders, key)
				require.NoError(t, err)
				want[id] = relay.CodeMalformedHeaders
			case 9:
				if round == 0 && i < 10 {
					want[r.insert(t, msg("nowhere", key, seq))[0]] = relay.CodeAttemptsExhausted
					break
				}
				fallthrough
			default:
				r.insert(t, msg(topicOrders, key, seq))
			}
			seq++
		}
		time.Sleep(30 * time.Millisecond)
		r.crash(t)
	}
	r.waitSettled(t, 25*time.Second)

	except := map[uuid.UUID]bool{}
	for id, code := range want {
		except[id] = true
		var status string
		var lastErr *string
		require.NoError(t, r.pool.QueryRow(r.ctx, `SELECT status, last_error FROM sagaflow.outbox WHERE id = $1`, id).Scan(&status, &lastErr))
		require.Equal(t, "dead", status, "row %s (%s)", id, code)
		require.NotNil(t, lastErr)
		require.True(t, strings.HasPrefix(*lastErr, code), "row %s: last_error %q does not start with %s", id, *lastErr, code)
	}
	byID, _ := r.onTopic(t, topicOrders)
	for id := range want {
		require.Empty(t, byID[id], "dead row %s is on the topic", id)
	}
	dups := r.requireAllDelivered(t, topicOrders, except)
	t.Logf("%d rows, %d parked dead, %d ids delivered more than once", len(r.written)+len(want), len(want), dups)
}

// TestHostileBytesAcrossCrashes: payloads with NUL and 0xff bytes, 10 kB
// values and keys, headers with odd names, empty and 10 kB values, and a
// forged sagaflow-message-id, across three crashes. Every copy must carry
// the row's own message id and its exact bytes.
func TestHostileBytesAcrossCrashes(t *testing.T) {
	t.Parallel()
	r := newRig(t, false)
	r.started(t, nil, r.writer(t), relay.Config{BatchSize: 7})
	big := strings.Repeat("é\u2028\U0001F600", 10_000/9)
	// PostgreSQL refuses NUL and invalid UTF-8 in text and jsonb: such a key
	// or header never becomes a row (recorded in FINDINGS.md as O1).
	for _, key := range []string{"a\x00b", "\xff\xfe"} {
		m := msg(topicOrders, key, -1)
		require.Error(t, r.st.InsertMessage(r.ctx, r.pool, &m), "key %q accepted", key)
	}
	// An invalid UTF-8 header value is accepted, and (JSON encoding) turned
	// into U+FFFD: the row must still be delivered, with that value (O2).
	m := msg(topicOrders, "k", -1)
	m.Headers = map[string]string{"h": "\xff"}
	badID := r.insert(t, m)[0]
	r.mu.Lock()
	w := r.written[badID]
	w.Headers = map[string]string{"h": "\uFFFD"}
	r.written[badID] = w
	r.mu.Unlock()

	forged := map[uuid.UUID]bool{}
	seq := 0
	for range 3 {
		for i := range 30 {
			m := msg(topicOrders, fmt.Sprintf("k%d", i%3), seq)
			switch i % 5 {
			case 0:
				m.Payload = append([]byte{0, 0xff, 0xfe, 0}, bytes.Repeat([]byte{0, 1, 0xc3, 0x28}, 2500)...)
			case 1:
				m.AggregateID = big
				m.Payload = []byte{}
			case 2:
				m.Headers = map[string]string{"": "empty name", "e": "", "big": big, "traceparent": "garbage\x01"}
			case 3:
				m.Headers = map[string]string{store.HeaderMessageID: uuid.NewString()}
				forged[m.ID] = true
			}
			r.insert(t, m)
			seq++
		}
		r.crash(t)
	}
	r.waitSettled(t, 20*time.Second)
	// onTopic compares key, value and headers of every copy; a forged
	// message id would name no row. Drop the forged header from the
	// expectation: the docs say the row's id replaces it.
	r.mu.Lock()
	for id := range forged {
		w := r.written[id]
		w.Headers = nil
		r.written[id] = w
	}
	r.mu.Unlock()
	dups := r.requireAllDelivered(t, topicOrders, nil)
	t.Logf("%d rows, %d ids delivered more than once", len(r.written), dups)
}

// TestRetentionAcrossCrashes: a relay that deletes published rows every
// 20 ms (Retention 1 ms) while PostgreSQL crashes three times. A crash that
// undoes marks must undo nothing else that loses a row: every good row is on
// the topic, the dead row and a row due later survive retention while they
// are dead or pending, and nothing is pending at the end.
func TestRetentionAcrossCrashes(t *testing.T) {
	t.Parallel()
	r := newRig(t, false)
	rl := r.started(t, nil, r.writer(t), relay.Config{BatchSize: 10, Retention: time.Millisecond,
		RetentionInterval: 20 * time.Millisecond, MaxMessageBytes: 4096})
	dead := msg(topicOrders, "dead", 0)
	dead.Payload = bytes.Repeat([]byte("y"), 8000)
	deadID := r.insert(t, dead)[0]
	later := msg(topicOrders, "later", 0)
	later.Delay = 3 * time.Second
	laterID := r.insert(t, later)[0]
	seq := 0
	for range 3 {
		for range 80 {
			r.insert(t, msg(topicOrders, fmt.Sprintf("k%d", seq%5), seq))
			seq++
		}
		r.crash(t)
		require.True(t, exists(r.ctx, r.pool, laterID) || func() bool {
			time.Sleep(100 * time.Millisecond)
			return exists(r.ctx, r.pool, laterID)
		}(), "the row due later was deleted while pending")
	}
	// The dead mark commits without waiting for the flush as the published
	// ones do, so the last crash may have undone it: the row is then
	// pending until the relay claims and parks it again (seen in CI).
	var status string
	require.Eventually(t, func() bool {
		return r.pool.QueryRow(r.ctx, `SELECT status FROM sagaflow.outbox WHERE id = $1`, deadID).Scan(&status) == nil &&
			status == "dead"
	}, 10*time.Second, 50*time.Millisecond, "the too large row is %q, not dead", status)
	// wait for the row due later, then for the rest.
	deadline := time.Now().Add(15 * time.Second)
	for {
		byID, _ := r.onTopic(t, topicOrders)
		if len(byID[laterID]) > 0 {
			break
		}
		require.True(t, time.Now().Before(deadline), "the row due later never reached the topic")
		time.Sleep(100 * time.Millisecond)
	}
	r.waitSettled(t, 15*time.Second)
	dups := r.requireAllDelivered(t, topicOrders, map[uuid.UUID]bool{deadID: true})
	var left int
	require.NoError(t, r.pool.QueryRow(r.ctx, `SELECT count(*) FROM sagaflow.outbox WHERE status = 'published'`).Scan(&left))
	h := r.healthAfterCrashes(t, rl)
	require.True(t, h.Running)
	t.Logf("%d rows, %d ids delivered more than once, %d published rows not yet deleted", len(r.written), dups, left)
}

// TestSweeperBesideLogicalRelayAcrossCrashes: the documented pair, a
// log-based relay and a polling relay with Sweeper set, while PostgreSQL
// (wal_level=logical) crashes twice. Rows due at once go through the
// stream, rows due later through the sweeper (whose marks are the polling
// relay's). Nothing may be lost; every copy carries its row's id.
func TestSweeperBesideLogicalRelayAcrossCrashes(t *testing.T) {
	t.Parallel()
	r := newRig(t, true, kafkatest.SeedTopics(3, topicOrders))
	w := r.writer(t)
	lr, err := relay.NewLogical(r.pool, r.srv.ConnString(), w, &relay.LogicalConfig{Schema: schema, Slot: "review22",
		Publication: "review22", StatusInterval: 100 * time.Millisecond, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, lr.Setup(r.ctx))
	ctx, cancel := context.WithCancel(r.ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			if err := lr.Run(ctx); err == nil {
				return
			}
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	t.Cleanup(func() { cancel(); wg.Wait() })
	r.started(t, nil, r.writer(t), relay.Config{Sweeper: true, SweepAfter: time.Second, BatchSize: 10})

	seq := 0
	for range 2 {
		for i := range 60 {
			m := msg(topicOrders, fmt.Sprintf("k%d", i%4), seq)
			if i%3 == 0 {
				m.Delay = 100 * time.Millisecond
			}
			r.insert(t, m)
			seq++
		}
		time.Sleep(300 * time.Millisecond) // the delayed rows come due and are swept
		r.crash(t)
	}
	r.waitSettled(t, 20*time.Second)
	dups := r.requireAllDelivered(t, topicOrders, nil)
	t.Logf("%d rows, %d ids delivered more than once", len(r.written), dups)
}
