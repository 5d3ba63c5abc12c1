package review20_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

type hostileStart struct {
	name string
	s    st
	key  string
}

// Bad bytes through the grouped start, its notification and the batches,
// in Postgres-only mode (2 workers, BatchSize 16) and Kafka mode (1
// partition, 1 worker, BatchSize 16), all started concurrently so that
// refused and accepted starts share groups:
//
//   - refused at start, writing nothing, with ErrInvalidInput (saga/doc.go
//     ErrInvalidInput: "a NUL byte, invalid UTF-8, a business key past its
//     index's limit"; CHANGELOG: "A state with a NUL character is refused"):
//     business keys with a NUL, of invalid UTF-8, of 10 kB and of 513 bytes
//     (one past wire.MaxKeyBytes, the limit the error names); a state with a
//     NUL in a string, and with an escaped NUL in raw JSON;
//   - accepted and completed, each effect once: 10 kB of letters in the
//     state, invalid UTF-8 in a Go string (encoded as U+FFFD), a 512-byte
//     business key, a key of Cyrillic and an emoji, nested raw JSON;
//   - a state made unstorable by step b (a NUL in a string; 10 kB of NULs):
//     CodeStateEncode, "the state a handler left cannot be stored": b fails
//     for good and a is compensated (effects a and a-undo once, b's rolled
//     back), while the batch's other sagas complete.
//
// Raw JSON holding invalid UTF-8 is refused at start (nothing written; its
// error is F3) and, left by step b, either completes or ends coded, c never
// run (how it ends is F2); both are logged.
func TestHostileBytesThroughTheBatch(t *testing.T) {
	t.Parallel()
	t.Run("F3_rawInvalidUTF8IsInvalidInput", rawInvalidUTF8IsInvalidInput)
	for _, mode := range []string{"postgres", "kafka"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			var c *chain
			var e, client *saga.Engine
			if mode == "postgres" {
				d := testkit.NewDB(t)
				c = newChain(t, d, "r20bytes")
				e, _ = testkit.StartEngine(t, d.Pool, patient(d, 2, 16), c.def)
				client = e
			} else {
				k := newKchain(t, "r20kbytes", 1)
				c, client = k.chain, k.client
				e, _ = testkit.StartEngine(t, k.db.Pool, kafkaMode(k.db, k.kc, 1, 16), k.def)
			}
			big := testkit.RandomLetters(10 << 10)
			refused := []hostileStart{
				{name: "key NUL", key: "a\x00b"},
				{name: "key invalid UTF-8", key: "k\xff\xfe"},
				{name: "key 10 kB", key: big},
				{name: "key 513 bytes", key: big[:513]},
				{name: "state NUL", s: st{Note: "x\x00y"}},
				{name: "state escaped NUL", s: st{Raw: json.RawMessage(`{"v":"\u0000"}`)}},
			}
			doubtful := []hostileStart{
				{name: "state raw invalid UTF-8", s: st{Raw: json.RawMessage("\"\xff\xfe\"")}},
			}
			accepted := []hostileStart{
				{name: "plain"}, {name: "plain2"}, {name: "plain3"}, {name: "plain4"},
				{name: "state 10 kB", s: st{Note: big}},
				{name: "state invalid UTF-8", s: st{Note: "u-\xff\xfe-v"}},
				{name: "key 512 bytes", key: big[:512]},
				{name: "key unicode", key: "ключ-🔑-" + mode},
				{name: "state nested raw", s: st{Raw: json.RawMessage(`{"deep":[1,2,{"x":"\u00e9"}]}`)}},
				{name: "b: NUL", s: st{Note: "to-nul"}},
				{name: "b: 10 kB NULs", s: st{Note: "to-nuls"}},
				{name: "b: raw invalid UTF-8", s: st{Note: "to-raw"}},
				{name: "plain5"}, {name: "plain6"},
			}
			c.setHook("*", "b", func(_ context.Context, _ *saga.StepRun, s *st) error {
				switch s.Note {
				case "to-nul":
					s.Note = "nul\x00here"
				case "to-nuls":
					s.Note = strings.Repeat("\x00", 10<<10)
				case "to-raw":
					s.Raw = json.RawMessage("\"\xff\xfe\"")
				}
				return nil
			})
			all := append(append(append([]hostileStart{}, refused...), doubtful...), accepted...)
			type result struct {
				id  uuid.UUID
				err error
			}
			res := make([]result, len(all))
			var wg sync.WaitGroup
			for i, h := range all {
				h.s.ID = h.name
				wg.Add(1)
				go func() {
					defer wg.Done()
					var opts *saga.StartOpts
					if h.key != "" {
						opts = &saga.StartOpts{BusinessKey: h.key}
					}
					s, err := saga.Start(context.Background(), client, c.def, h.s, opts)
					res[i] = result{s.ID, err}
				}()
			}
			wg.Wait()
			started := 0
			for i, h := range all {
				r := res[i]
				switch {
				case i < len(refused):
					require.Error(t, r.err, h.name)
					require.True(t, errors.Is(r.err, saga.ErrInvalidInput), "%s: %v", h.name, r.err)
				case i < len(refused)+len(doubtful):
					t.Logf("%s: start error %v", h.name, r.err)
					// Refused or stored, never half-written (the count of
					// sagas below); whether the error wraps ErrInvalidInput
					// is F3 (subtest F3_rawInvalidUTF8IsInvalidInput).
					if r.err == nil {
						started++
						in := endedWithin(t, e, r.id, wait)
						t.Logf("%s: %s, state %s", h.name, in.Status, short(string(in.State)))
						require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v", h.name, testkit.Timeline(in))
					}
				default:
					require.NoError(t, r.err, h.name)
					started++
				}
			}
			for i, h := range all[len(refused)+len(doubtful):] {
				id := res[len(refused)+len(doubtful)+i].id
				in := endedWithin(t, e, id, wait)
				fx := c.effects(t, id)
				switch {
				case h.name == "b: NUL" || h.name == "b: 10 kB NULs":
					// CodeStateEncode: "the state a handler left cannot be
					// stored"; a failure for good, so a is compensated.
					require.Equal(t, saga.StatusCompensated, in.Status, "%s: %v", h.name, testkit.Timeline(in))
					require.NotNil(t, in.LastError, "%s: %v", h.name, testkit.Timeline(in))
					require.Equal(t, saga.CodeStateEncode, in.LastError.Code, "%s: %v", h.name, testkit.Timeline(in))
					require.Equal(t, map[string]int{"a": 1, "a-undo": 1}, fx, "%s: %v", h.name, testkit.Timeline(in))
				case h.name == "b: raw invalid UTF-8":
					t.Logf("%s: %s, effects %v, last error %+v", h.name, in.Status, fx, in.LastError)
					if in.Status != saga.StatusCompleted {
						require.NotNil(t, in.LastError, "%s: %v", h.name, testkit.Timeline(in))
						// invalid_outcome is documented; tx_aborted after
						// every attempt and a compensation is what happens
						// (F2, TestOutcomeRefusedByAnInsertTrigger/F2_parksItsSaga).
						require.Contains(t, []string{saga.CodeInvalidOutcome, saga.CodeStateEncode, saga.CodeTxAborted}, in.LastError.Code,
							"%s: %v", h.name, testkit.Timeline(in))
						require.Zero(t, fx["c"], "%s: %v", h.name, fx)
					} else {
						require.Equal(t, completed, fx, h.name)
					}
				default:
					require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v", h.name, testkit.Timeline(in))
					require.Equal(t, completed, fx, "%s: %v", h.name, testkit.Timeline(in))
					if h.key != "" {
						require.Equal(t, h.key, in.BusinessKey, h.name)
					}
				}
				if h.name == "state invalid UTF-8" {
					var s st
					require.NoError(t, in.DecodeState(&s))
					require.Equal(t, "u-\uFFFD\uFFFD-v", s.Note)
				}
				if h.name == "state 10 kB" {
					var s st
					require.NoError(t, in.DecodeState(&s))
					require.Equal(t, big, s.Note)
				}
			}
			require.Equal(t, started, c.db.Count(t, "SELECT count(*) FROM "+c.db.Table("saga_instances")),
				"sagas stored: a refused start wrote something")
			require.Empty(t, doubles(t, c.fx, c.db))
			t.Logf("%s: %+v", mode, e.Stats())
		})
	}
}

// Two tenants (two schemas) in Kafka mode on one broker, the same saga
// name, each with its own CommandTopic (KafkaConfig: "Engines of another
// schema on the same cluster need another Config.CommandTopic too"), relay
// and engine (2 workers, BatchSize 16) polling once a minute: 25 sagas in
// each, started at the same time, with the same business keys and states
// in both (some of 10 kB). Each tenant's sagas complete with each effect
// once, in its own schema only, neither tenant dead-letters anything (a
// consumer reading the other's commands would dead-letter or run them), and
// no message is published twice on either topic.
func TestTwoTenantsKafkaModeOnOneBroker(t *testing.T) {
	t.Parallel()
	const name = "r20ten"
	topics := []string{"t0.commands." + name, "t1.commands." + name}
	kc := kafkatest.New(t, kafkatest.SeedTopics(2, topics...))
	type tenant struct {
		c      *chain
		e      *saga.Engine
		client *saga.Engine
	}
	var ts []tenant
	for n := range 2 {
		d := testkit.NewDB(t)
		testkit.RelayPolling(t, kc.Addrs(), d, poll)
		c := newChain(t, d, name)
		cfg := kafkaMode(d, kc, 2, 16)
		cfg.CommandTopic = fmt.Sprintf("t%d.commands", n)
		e, _ := testkit.StartEngine(t, d.Pool, cfg, c.def)
		ts = append(ts, tenant{c: c, e: e, client: e})
	}
	big := testkit.RandomLetters(10 << 10)
	ids := make([][]uuid.UUID, 2)
	errs := make(chan error, 50)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for n := range 2 {
		ids[n] = make([]uuid.UUID, 25)
		for i := range 25 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s := st{ID: fmt.Sprint("o", i)}
				if i%5 == 0 {
					s.Note = big
				}
				r, err := saga.Start(context.Background(), ts[n].client, ts[n].c.def, s, &saga.StartOpts{BusinessKey: fmt.Sprint("order-", i)})
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				ids[n][i] = r.ID
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for n, tn := range ts {
		for i, id := range ids[n] {
			in := endedWithin(t, tn.e, id, wait)
			require.Equal(t, saga.StatusCompleted, in.Status, "tenant %d o%d: %v", n, i, testkit.Timeline(in))
			require.Equal(t, completed, tn.c.effects(t, id), "tenant %d o%d", n, i)
			require.Equal(t, fmt.Sprint("order-", i), in.BusinessKey)
		}
		d := tn.c.db
		require.Zero(t, d.Count(t, "SELECT count(*) FROM "+tn.c.fx.Table()+" f WHERE NOT EXISTS (SELECT 1 FROM "+
			d.Table("saga_instances")+" s WHERE s.id = f.saga_id)"), "tenant %d: effects of sagas it does not have", n)
		require.Equal(t, 75, d.Count(t, "SELECT count(*) FROM "+tn.c.fx.Table()), "tenant %d: effects", n)
		page, err := tn.e.DeadLetters(context.Background(), &saga.DeadOpts{Limit: 100})
		require.NoError(t, err)
		require.Empty(t, page.Letters, "tenant %d dead-lettered", n)
		all, err := kc.ReadAll(context.Background(), topics[n])
		require.NoError(t, err)
		seen := map[string]int{}
		for _, m := range all {
			for _, hd := range m.Headers {
				if hd.Key == "sagaflow-message-id" {
					seen[string(hd.Value)]++
				}
			}
		}
		require.Len(t, all, len(seen), "tenant %d: a message published twice (relay/doc.go: \"without crashes every row is published once\")", n)
		t.Logf("tenant %d: %d messages on its topic; %+v", n, len(all), tn.e.Stats())
	}
}

// F3 (a subtest of TestHostileBytesThroughTheBatch). ErrInvalidInput "wraps every refusal of a caller's string that
// PostgreSQL could not store or compare (a NUL byte, invalid UTF-8, ...)",
// and a state with a NUL is refused with it (CHANGELOG, review9 F1). A
// state whose json.RawMessage field holds invalid UTF-8 (valid JSON to
// encoding/json, refused by jsonb) is refused too, and nothing is written,
// but with PostgreSQL's own error (SQLSTATE 22021), which does not wrap
// ErrInvalidInput: a caller mapping ErrInvalidInput to "400 Bad Request"
// answers 500. Both Start (grouped) and StartTx.
func rawInvalidUTF8IsInvalidInput(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	c := newChain(t, d, "r20utf8")
	e := testkit.NewEngine(t, d.Pool, patient(d, 1, 16), c.def)
	ctx := context.Background()
	_, err := saga.Start(ctx, e, c.def, st{ID: "x", Raw: json.RawMessage("\"\xff\"")}, nil)
	require.ErrorIs(t, err, saga.ErrInvalidInput)
	tx, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, err = saga.StartTx(ctx, e, tx, c.def, st{ID: "y", Raw: json.RawMessage("\"\xff\"")}, nil)
	require.ErrorIs(t, err, saga.ErrInvalidInput)
}
