package review9_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// saga/doc.go "Starts share commits": Start (on the engine's pool) joins
// starts made while another commits, up to 128 per transaction, each
// returning only once its saga has committed; a failed group, a refused
// start or one waiting > 50 ms on a business key held elsewhere runs each
// start again alone. Stats.StartsGrouped counts grouped starts.

type startResult struct {
	st   saga.Started
	err  error
	took time.Duration
	// visible: Get found the saga right after Start returned.
	visible error
}

// startAll runs the starts at once (behind a barrier) and returns their
// results, in order.
func startAll(e *saga.Engine, def *saga.Definition[order], n int, arg func(i int) (context.Context, order, *saga.StartOpts)) []startResult {
	out := make([]startResult, n)
	var wg sync.WaitGroup
	gate := make(chan struct{})
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			ctx, st, opts := arg(i)
			<-gate
			t0 := time.Now()
			r, err := saga.Start(ctx, e, def, st, opts)
			out[i] = startResult{st: r, err: err, took: time.Since(t0)}
			if err == nil {
				_, out[i].visible = e.Get(context.Background(), r.ID)
			}
		}(i)
	}
	close(gate)
	wg.Wait()
	return out
}

func TestConcurrentStartsDuplicateKeysAndIDs(t *testing.T) {
	d := newDB(t)
	def := orderDef(d, "review9.dups", "", 3, 0, nil)
	e, _ := testkit.StartEngine(t, d.Pool, engineConfig(d), def)

	const (
		keyed    = 40 // keys, each started by 4 goroutines
		perKey   = 4
		idNoKey  = 10 // ids without a key, each started twice
		idTwoKey = 10 // ids each started with two different keys
		plain    = 20
	)
	n := keyed*perKey + idNoKey*2 + idTwoKey*2 + plain
	ids := make([]uuid.UUID, idNoKey+idTwoKey)
	for i := range ids {
		ids[i] = uuid.New()
	}
	kind := func(i int) (string, int) {
		switch {
		case i < keyed*perKey:
			return "key", i % keyed
		case i < keyed*perKey+idNoKey*2:
			return "idnokey", (i - keyed*perKey) % idNoKey
		case i < keyed*perKey+idNoKey*2+idTwoKey*2:
			j := i - keyed*perKey - idNoKey*2
			return "idtwokey", j
		default:
			return "plain", i
		}
	}
	res := startAll(e, def, n, func(i int) (context.Context, order, *saga.StartOpts) {
		k, j := kind(i)
		switch k {
		case "key":
			key := fmt.Sprintf("dup-%d", j)
			return context.Background(), order{Key: key}, &saga.StartOpts{BusinessKey: key}
		case "idnokey":
			return context.Background(), order{Key: "idnokey"}, &saga.StartOpts{ID: ids[j]}
		case "idtwokey":
			key := fmt.Sprintf("two-%d-%d", j%idTwoKey, j/idTwoKey)
			return context.Background(), order{Key: key}, &saga.StartOpts{ID: ids[idNoKey+j%idTwoKey], BusinessKey: key}
		default:
			return context.Background(), order{Key: "plain"}, nil
		}
	})

	started := map[uuid.UUID]bool{}
	byKey := map[int][]startResult{}
	byIDNoKey := map[int][]startResult{}
	byIDTwoKey := map[int][]startResult{}
	var lat []time.Duration
	for i, r := range res {
		lat = append(lat, r.took)
		k, j := kind(i)
		if k != "idtwokey" {
			require.NoError(t, r.err, "start %d (%s)", i, k)
		}
		if r.err == nil {
			require.NoError(t, r.visible, "start %d (%s) returned before its saga was visible", i, k)
			started[r.st.ID] = true
		}
		switch k {
		case "key":
			byKey[j] = append(byKey[j], r)
		case "idnokey":
			byIDNoKey[j] = append(byIDNoKey[j], r)
		case "idtwokey":
			byIDTwoKey[j%idTwoKey] = append(byIDTwoKey[j%idTwoKey], r)
		default:
			require.False(t, r.st.Existing)
		}
	}
	t.Logf("latencies of %d concurrent starts: %s", n, durations(lat))
	for j, rs := range byKey {
		fresh := 0
		for _, r := range rs {
			require.Equal(t, rs[0].st.ID, r.st.ID, "key dup-%d: every start returns the same saga", j)
			if !r.st.Existing {
				fresh++
			}
		}
		require.Equal(t, 1, fresh, "key dup-%d: exactly one start is not Existing", j)
	}
	for j, rs := range byIDNoKey {
		require.Len(t, rs, 2)
		require.Equal(t, ids[j], rs[0].st.ID)
		require.Equal(t, ids[j], rs[1].st.ID)
		require.True(t, rs[0].st.Existing != rs[1].st.Existing, "id %d without key: exactly one Existing (got %v, %v)", j, rs[0].st.Existing, rs[1].st.Existing)
	}
	for j, rs := range byIDTwoKey {
		require.Len(t, rs, 2)
		ok, taken := 0, 0
		for _, r := range rs {
			switch {
			case r.err == nil:
				ok++
				require.False(t, r.st.Existing)
				require.Equal(t, ids[idNoKey+j], r.st.ID)
			case errors.Is(r.err, saga.ErrSagaIDTaken):
				taken++
			default:
				t.Fatalf("id %d with two keys: unexpected error %v", j, r.err)
			}
		}
		require.Equal(t, 1, ok, "id %d with two keys: one start wins", j)
		require.Equal(t, 1, taken, "id %d with two keys: the other gets ErrSagaIDTaken", j)
	}
	want := keyed + idNoKey + idTwoKey + plain
	require.Len(t, started, want)
	require.Len(t, allSagas(t, e, def.Name()), want, "sagas in the database")

	waitAllCompleted(t, e, def.Name(), want, 60*time.Second)
	d.requireEffectsOnce(t, started, 3)
	s := e.Stats()
	t.Logf("StartsGrouped=%d of %d starts", s.StartsGrouped, n)
	require.LessOrEqual(t, s.StartsGrouped, int64(n))
}

// Bad input: each bad start gets ErrInvalidInput naming the field; the
// good starts made with it all succeed, promptly.
func TestBadStartsDoNotHurtGoodOnes(t *testing.T) {
	d := newDB(t)
	def := orderDef(d, "review9.bad", "", 2, 0, nil)
	e, _ := testkit.StartEngine(t, d.Pool, engineConfig(d), def)

	bad := []struct{ name, key string }{
		{"nul", "po\x00ison"},
		{"utf8", "po\xff\xfeison"},
		{"10kB", testkit.RandomLetters(10 << 10)},
	}
	// Alone first: the errors.
	for _, b := range bad {
		_, err := saga.Start(context.Background(), e, def, order{Key: "x"}, &saga.StartOpts{BusinessKey: b.key})
		require.Error(t, err, b.name)
		require.ErrorIs(t, err, saga.ErrInvalidInput, "%s: %v", b.name, err)
		norm := strings.NewReplacer("_", "", " ", "", ".", "").Replace(strings.ToLower(err.Error()))
		require.Contains(t, norm, "businesskey", "%s: the error names the field: %v", b.name, err)
		require.Less(t, len(err.Error()), 2000, "%s: the error does not echo a 10 kB key", b.name)
	}

	// Then mixed with good ones, several rounds.
	const good, badEach, rounds = 60, 4, 3
	started := map[uuid.UUID]bool{}
	var goodLat, badLat []time.Duration
	for round := 0; round < rounds; round++ {
		n := good + badEach*len(bad)
		res := startAll(e, def, n, func(i int) (context.Context, order, *saga.StartOpts) {
			if i < good {
				key := fmt.Sprintf("good-%d-%d", round, i)
				return context.Background(), order{Key: key}, &saga.StartOpts{BusinessKey: key}
			}
			b := bad[(i-good)%len(bad)]
			return context.Background(), order{Key: "bad"}, &saga.StartOpts{BusinessKey: b.key}
		})
		for i, r := range res {
			if i < good {
				require.NoError(t, r.err, "round %d: a good start failed next to bad ones", round)
				require.NoError(t, r.visible)
				require.False(t, r.st.Existing)
				started[r.st.ID] = true
				goodLat = append(goodLat, r.took)
				continue
			}
			b := bad[(i-good)%len(bad)]
			require.ErrorIs(t, r.err, saga.ErrInvalidInput, "round %d %s: %v", round, b.name, r.err)
			badLat = append(badLat, r.took)
		}
	}
	t.Logf("good starts next to bad ones: %s; bad ones: %s", durations(goodLat), durations(badLat))
	for _, l := range goodLat {
		require.Less(t, l, 5*time.Second, "a good start waited long next to bad ones")
	}
	require.Len(t, allSagas(t, e, def.Name()), len(started), "bad starts stored nothing")
	waitAllCompleted(t, e, def.Name(), len(started), 60*time.Second)
	d.requireEffectsOnce(t, started, 2)
}

// A state with a NUL in a string encodes to JSON "\u0000", which a jsonb
// column refuses: the start must fail clearly (or succeed and round-trip),
// and never hurt the starts grouped with it.
func TestStateWithNULNextToGoodStarts(t *testing.T) {
	d := newDB(t)
	def := orderDef(d, "review9.nulstate", "", 1, 0, nil)
	e, _ := testkit.StartEngine(t, d.Pool, engineConfig(d), def)

	_, aloneErr := saga.Start(context.Background(), e, def, order{Key: "k", Note: "a\x00b"}, nil)
	t.Logf("alone: state with NUL: %v", aloneErr)

	const good, badN = 50, 6
	res := startAll(e, def, good+badN, func(i int) (context.Context, order, *saga.StartOpts) {
		if i < good {
			return context.Background(), order{Key: fmt.Sprint(i)}, nil
		}
		return context.Background(), order{Key: "nul", Note: "a\x00b"}, nil
	})
	started := map[uuid.UUID]bool{}
	for i, r := range res {
		if i < good {
			require.NoError(t, r.err, "a good start failed next to a NUL state")
			started[r.st.ID] = true
			continue
		}
		if aloneErr != nil {
			require.Error(t, r.err, "same input, same answer as alone")
		} else {
			require.NoError(t, r.err)
			started[r.st.ID] = true
		}
	}
	if aloneErr != nil {
		require.NotContains(t, aloneErr.Error(), "SQLSTATE 25P02", "the error is the cause, not an aborted transaction")
		t.Logf("grouped NUL-state error: %v", res[good].err)
	} else {
		in, err := e.Get(context.Background(), res[good].st.ID)
		require.NoError(t, err)
		var o order
		require.NoError(t, in.DecodeState(&o))
		require.Equal(t, "a\x00b", o.Note)
	}
	waitAllCompleted(t, e, def.Name(), len(started), 60*time.Second)
	d.requireEffectsOnce(t, started, 1)
	if aloneErr != nil {
		require.ErrorIs(t, aloneErr, saga.ErrInvalidInput, "a state PostgreSQL cannot store (a NUL) is refused (F1)")
	}
}

// A business key inserted by an open StartTx: other starts return
// promptly; the start of that key returns the held saga (Existing) after
// commit, or a new saga after rollback.
func TestHeldBusinessKey(t *testing.T) {
	for _, commit := range []bool{true, false} {
		for _, burst := range []bool{false, true} {
			name := fmt.Sprintf("commit=%v/burst=%v", commit, burst)
			t.Run(name, func(t *testing.T) { heldKey(t, commit, burst) })
		}
	}
}

func heldKey(t *testing.T, commit, burst bool) {
	d := newDB(t)
	def := orderDef(d, "review9.held", "", 2, 0, nil)
	e, _ := testkit.StartEngine(t, d.Pool, engineConfig(d), def)
	ctx := context.Background()

	tx, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	held, err := saga.StartTx(ctx, e, tx, def, order{Key: "K"}, &saga.StartOpts{BusinessKey: "K"})
	require.NoError(t, err)
	require.False(t, held.Existing)

	type kres struct {
		st   saga.Started
		err  error
		took time.Duration
	}
	kdone := make(chan kres, 1)
	t0 := time.Now()
	go func() {
		r, err := saga.Start(ctx, e, def, order{Key: "K"}, &saga.StartOpts{BusinessKey: "K"})
		kdone <- kres{r, err, time.Since(t0)}
	}()
	if !burst {
		time.Sleep(200 * time.Millisecond) // the K start is alone, blocked
	}
	const others = 40
	started := map[uuid.UUID]bool{}
	var lat []time.Duration
	for round := 0; round < 3; round++ {
		res := startAll(e, def, others, func(i int) (context.Context, order, *saga.StartOpts) {
			key := fmt.Sprintf("other-%d-%d", round, i)
			return ctx, order{Key: key}, &saga.StartOpts{BusinessKey: key}
		})
		for _, r := range res {
			require.NoError(t, r.err)
			require.NoError(t, r.visible)
			started[r.st.ID] = true
			lat = append(lat, r.took)
		}
	}
	t.Logf("starts while K is held: %s; StartsGrouped=%d", durations(lat), e.Stats().StartsGrouped)
	for _, l := range lat {
		require.Less(t, l, 2*time.Second, "a start waited for a business key it does not use")
	}
	select {
	case r := <-kdone:
		t.Fatalf("the start of held key K returned before the holder ended: %+v", r)
	default:
	}

	tEnd := time.Now()
	if commit {
		require.NoError(t, tx.Commit(ctx))
	} else {
		require.NoError(t, tx.Rollback(ctx))
	}
	r := testkit.Recv(t, kdone, 10*time.Second, "the start of K to return after the holder's end")
	t.Logf("start of K returned %s after the holder ended (%s after it began)", time.Since(tEnd).Round(time.Millisecond), r.took.Round(time.Millisecond))
	require.NoError(t, r.err)
	if commit {
		require.Equal(t, held.ID, r.st.ID)
		require.True(t, r.st.Existing, "after commit, K's start finds the held saga")
	} else {
		require.NotEqual(t, held.ID, r.st.ID)
		require.False(t, r.st.Existing, "after rollback, K's start starts a new saga")
	}
	started[r.st.ID] = true
	waitAllCompleted(t, e, def.Name(), len(started), 60*time.Second)
	d.requireEffectsOnce(t, started, 2)
}

// Several starts blocked on one held key: a careless user retrying the
// same order in many goroutines. The docs say no start waits for another's
// lock; each blocked start holds a pool connection, though.
func TestManyStartsOnOneHeldKey(t *testing.T) {
	d := newDB(t)
	def := orderDef(d, "review9.heldmany", "", 1, 0, nil)
	e := testkit.NewEngine(t, d.Pool, engineConfig(d), def) // a client: no workers use the pool
	ctx := context.Background()
	maxConns := int(d.Pool.Config().MaxConns)

	tx, err := d.Pool.Begin(ctx)
	require.NoError(t, err)
	held, err := saga.StartTx(ctx, e, tx, def, order{Key: "K"}, &saga.StartOpts{BusinessKey: "K"})
	require.NoError(t, err)

	blocked := maxConns / 2 // leaves connections for the others
	var wg sync.WaitGroup
	kerrs := make(chan error, blocked)
	for i := 0; i < blocked; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := saga.Start(ctx, e, def, order{Key: "K"}, &saga.StartOpts{BusinessKey: "K"})
			if err == nil && (r.ID != held.ID || !r.Existing) {
				err = fmt.Errorf("got %+v, want the held saga %s", r, held.ID)
			}
			kerrs <- err
		}()
	}
	time.Sleep(300 * time.Millisecond)
	res := startAll(e, def, 30, func(i int) (context.Context, order, *saga.StartOpts) {
		return ctx, order{Key: fmt.Sprint(i)}, &saga.StartOpts{BusinessKey: fmt.Sprint("o-", i)}
	})
	var lat []time.Duration
	for _, r := range res {
		require.NoError(t, r.err)
		lat = append(lat, r.took)
	}
	t.Logf("pool of %d connections, %d starts blocked on K; other starts: %s", maxConns, blocked, durations(lat))
	require.NoError(t, tx.Commit(ctx))
	wg.Wait()
	close(kerrs)
	for err := range kerrs {
		require.NoError(t, err)
	}
	for _, l := range lat {
		require.Less(t, l, 2*time.Second, "a start waited behind starts blocked on another key")
	}
}

// Contexts cancelled before the start, and at random moments while it
// runs: the error says so, no saga is started twice, a retry with the
// same id and key finds the saga, and every saga runs each step once.
func TestCancelledStarts(t *testing.T) {
	d := newDB(t)
	def := orderDef(d, "review9.cancel", "", 2, 0, nil)
	e, _ := testkit.StartEngine(t, d.Pool, engineConfig(d), def)

	// Before: half the starts of a burst have a cancelled context.
	const n = 60
	ids := make([]uuid.UUID, n)
	for i := range ids {
		ids[i] = uuid.New()
	}
	dead, cancel := context.WithCancel(context.Background())
	cancel()
	res := startAll(e, def, n, func(i int) (context.Context, order, *saga.StartOpts) {
		ctx := context.Background()
		if i%2 == 1 {
			ctx = dead
		}
		return ctx, order{Key: fmt.Sprint(i)}, &saga.StartOpts{ID: ids[i], BusinessKey: fmt.Sprint("pre-", i)}
	})
	started := map[uuid.UUID]bool{}
	var leaked []string
	for i, r := range res {
		if i%2 == 0 {
			require.NoError(t, r.err, "a start next to cancelled ones failed")
			started[r.st.ID] = true
			continue
		}
		require.Error(t, r.err, "a start with a cancelled context")
		require.True(t, isCtxErr(r.err), "the error says the context ended: %v", r.err)
		if _, err := e.Get(context.Background(), ids[i]); !errors.Is(err, saga.ErrNotFound) {
			leaked = append(leaked, ids[i].String())
		}
	}
	require.Empty(t, leaked, "starts whose context was cancelled before the call started a saga")

	// While: deadlines of 0-3 ms.
	const m = 150
	ids2 := make([]uuid.UUID, m)
	for i := range ids2 {
		ids2[i] = uuid.New()
	}
	cancels := make([]context.CancelFunc, m)
	res = startAll(e, def, m, func(i int) (context.Context, order, *saga.StartOpts) {
		ctx, c := context.WithTimeout(context.Background(), time.Duration(i%4)*time.Millisecond+time.Duration(i%50)*3*time.Millisecond)
		cancels[i] = c
		return ctx, order{Key: fmt.Sprint(i)}, &saga.StartOpts{ID: ids2[i], BusinessKey: fmt.Sprint("mid-", i)}
	})
	for _, c := range cancels {
		c()
	}
	failed, okN, committedAnyway := 0, 0, 0
	var otherErrs []string
	for i, r := range res {
		if r.err == nil {
			okN++
			require.Equal(t, ids2[i], r.st.ID)
			require.NoError(t, r.visible)
			continue
		}
		failed++
		if !isCtxErr(r.err) {
			otherErrs = append(otherErrs, r.err.Error())
		}
		if _, err := e.Get(context.Background(), ids2[i]); err == nil {
			committedAnyway++
			require.Contains(t, r.err.Error(), "may have been started", "a start that failed but committed must say it may have started: %v", r.err)
		} else if strings.Contains(r.err.Error(), "nothing was started") {
			require.ErrorIs(t, err, saga.ErrNotFound, "a start that says nothing was started")
		}
		// The careful user retries with the same id and key.
		rr, err := saga.Start(context.Background(), e, def, order{Key: fmt.Sprint(i)}, &saga.StartOpts{ID: ids2[i], BusinessKey: fmt.Sprint("mid-", i)})
		require.NoError(t, err, "retry of a cancelled start")
		require.Equal(t, ids2[i], rr.ID)
	}
	t.Logf("mid-start cancels: %d returned ok, %d failed (%d of those had committed anyway)", okN, failed, committedAnyway)
	require.Empty(t, otherErrs, "errors of cancelled starts say the context ended")
	// F2 (fixed): a start whose statement was sent may still commit after its
	// context ended; Start's doc now says so, and the error says which case
	// it is (checked above).
	for _, id := range ids2 {
		started[id] = true
	}
	waitAllCompleted(t, e, def.Name(), len(started), 60*time.Second)
	d.requireEffectsOnce(t, started, 2)
}

// Two tenants: engines on two schemas share one pool (and a third on its
// own pool), the same saga name and the same business keys, and start at
// once. Nothing crosses.
func TestTenantsDoNotCross(t *testing.T) {
	d1 := newDB(t)
	_, schema2 := pgtest.NewSchema(t)
	d2 := migrate(t, d1.Pool, schema2) // tenant 2's schema, on tenant 1's pool
	d3 := newDB(t)                     // tenant 3, its own pool

	const name = "review9.tenant"
	type tenant struct {
		d   *db
		e   *saga.Engine
		def *saga.Definition[order]
		tag string
	}
	var ts []*tenant
	for i, d := range []*db{d1, d2, d3} {
		tag := fmt.Sprint("t", i+1)
		def := orderDef(d, name, tag, 2, 0, nil)
		e, _ := testkit.StartEngine(t, d.Pool, engineConfig(d), def)
		ts = append(ts, &tenant{d: d, def: def, tag: tag, e: e})
	}
	const n = 80
	type out struct {
		ids map[uuid.UUID]bool
		res []startResult
	}
	outs := make([]out, len(ts))
	var wg sync.WaitGroup
	for ti, tn := range ts {
		wg.Add(1)
		go func(ti int, tn *tenant) {
			defer wg.Done()
			outs[ti].res = startAll(tn.e, tn.def, n, func(i int) (context.Context, order, *saga.StartOpts) {
				key := fmt.Sprint("order-", i)
				return context.Background(), order{Key: key, Tenant: tn.tag}, &saga.StartOpts{BusinessKey: key}
			})
		}(ti, tn)
	}
	wg.Wait()
	for ti, tn := range ts {
		outs[ti].ids = map[uuid.UUID]bool{}
		for i, r := range outs[ti].res {
			require.NoError(t, r.err, "%s start %d", tn.tag, i)
			require.False(t, r.st.Existing, "%s start %d found another tenant's saga", tn.tag, i)
			require.NoError(t, r.visible, "%s start %d is not in its own schema", tn.tag, i)
			outs[ti].ids[r.st.ID] = true
		}
		require.Len(t, outs[ti].ids, n)
	}
	for ti, tn := range ts {
		for oi := range ts {
			if oi == ti {
				continue
			}
			for id := range outs[oi].ids {
				_, err := tn.e.Get(context.Background(), id)
				require.ErrorIs(t, err, saga.ErrNotFound, "%s sees a saga of %s", tn.tag, ts[oi].tag)
			}
		}
	}
	for ti, tn := range ts {
		waitAllCompleted(t, tn.e, name, n, 60*time.Second)
		tn.d.requireEffectsOnce(t, outs[ti].ids, 2)
		require.Zero(t, tn.d.Count(t, `SELECT count(*) FROM `+tn.d.effects.Table()+` WHERE what LIKE '%wrong-tenant%' OR tenant <> $1`, tn.tag))
	}
}

// Stats.StartsGrouped: starts one after the other never share a commit
// ("goes at once when no other start is committing"); a burst does.
func TestStartsGroupedCounts(t *testing.T) {
	d := newDB(t)
	def := orderDef(d, "review9.stats", "", 1, 0, nil)
	client := testkit.NewEngine(t, d.Pool, engineConfig(d), def)
	ctx := context.Background()
	for i := 0; i < 30; i++ {
		_, err := saga.Start(ctx, client, def, order{Key: fmt.Sprint(i)}, nil)
		require.NoError(t, err)
	}
	require.Zero(t, client.Stats().StartsGrouped, "sequential starts are never grouped")

	const n = 300
	res := startAll(client, def, n, func(i int) (context.Context, order, *saga.StartOpts) {
		return ctx, order{Key: fmt.Sprint(i)}, nil
	})
	for _, r := range res {
		require.NoError(t, r.err)
	}
	g := client.Stats().StartsGrouped
	t.Logf("StartsGrouped after a burst of %d: %d", n, g)
	require.Positive(t, g, "a burst of concurrent starts shares commits")
	require.LessOrEqual(t, g, int64(n))

	// A burst in which some starts are refused: the group runs again start
	// by start; what is counted as grouped must have committed grouped.
	before := client.Stats().StartsGrouped
	res = startAll(client, def, n, func(i int) (context.Context, order, *saga.StartOpts) {
		if i%10 == 0 {
			return ctx, order{Key: "bad"}, &saga.StartOpts{BusinessKey: "x\x00y"}
		}
		return ctx, order{Key: fmt.Sprint(i)}, nil
	})
	goodN := 0
	for i, r := range res {
		if i%10 == 0 {
			require.ErrorIs(t, r.err, saga.ErrInvalidInput)
		} else {
			require.NoError(t, r.err)
			goodN++
		}
	}
	g2 := client.Stats().StartsGrouped - before
	t.Logf("StartsGrouped in a burst with refused starts: %d of %d good", g2, goodN)
	require.LessOrEqual(t, g2, int64(goodN), "refused starts are not counted as committed together")
	require.Len(t, allSagas(t, client, def.Name()), 30+n+goodN)
}

// As many starts blocked on held keys as the engine's pool has
// connections: the docs promise that no start waits for another's lock.
func TestHeldKeysAsManyAsThePool(t *testing.T) {
	d := newDB(t)
	def := orderDef(d, "review9.heldpool", "", 1, 0, nil)
	e := testkit.NewEngine(t, d.Pool, engineConfig(d), def)
	ctx := context.Background()
	maxConns := int(d.Pool.Config().MaxConns)

	// The holders use a pool of their own.
	holders, _ := pgtest.NewSchema(t)
	var txs []interface{ Rollback(context.Context) error }
	for i := 0; i < maxConns; i++ {
		tx, err := holders.Begin(ctx)
		require.NoError(t, err)
		_, err = saga.StartTx(ctx, e, tx, def, order{Key: "h"}, &saga.StartOpts{BusinessKey: fmt.Sprint("held-", i)})
		require.NoError(t, err)
		txs = append(txs, tx)
	}
	var wg sync.WaitGroup
	block := func(i int) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _ = saga.Start(ctx, e, def, order{Key: "h"}, &saga.StartOpts{BusinessKey: fmt.Sprint("held-", i)})
		}()
	}
	for i := 0; i < maxConns-1; i++ {
		block(i)
	}
	time.Sleep(300 * time.Millisecond)
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	t0 := time.Now()
	_, err := saga.Start(short, e, def, order{Key: "free"}, &saga.StartOpts{BusinessKey: "free-1"})
	took := time.Since(t0)
	cancel()
	t.Logf("pool of %d, %d starts blocked on held keys: an unrelated start took %s: %v", maxConns, maxConns-1, took.Round(time.Millisecond), err)
	require.NoError(t, err, "one connection left: an unrelated start goes through")
	require.Less(t, took, 2*time.Second)

	block(maxConns - 1)
	time.Sleep(300 * time.Millisecond)
	short, cancel = context.WithTimeout(ctx, 3*time.Second)
	t0 = time.Now()
	_, err = saga.Start(short, e, def, order{Key: "free"}, &saga.StartOpts{BusinessKey: "free-2"})
	took = time.Since(t0)
	cancel()
	for _, tx := range txs {
		require.NoError(t, tx.Rollback(ctx))
	}
	wg.Wait()
	t.Logf("pool of %d, %d starts blocked on held keys: an unrelated start took %s: %v", maxConns, maxConns, took.Round(time.Millisecond), err)
	if err != nil {
		require.True(t, isCtxErr(err), "%v", err)
		time.Sleep(time.Second)
		l, lerr := e.List(ctx, &saga.ListOpts{Name: def.Name(), BusinessKey: "free-2"})
		require.NoError(t, lerr)
		t.Logf("the start that returned %q: %d saga(s) with its key after the holders ended", err, len(l.Sagas))
		t.Skipf("FINDING F3: with as many starts blocked on held business keys as the pool has connections, an unrelated start waits for the holders (%s, %v)", took.Round(time.Millisecond), err)
	}
}

// A start whose context ends while it still waits for a connection (the
// application holds the whole pool for a moment) returns an error; it must
// not start its saga later, after the caller gave up.
func TestStartGivenUpBeforeItWasSent(t *testing.T) {
	d := newDB(t)
	def := orderDef(d, "review9.givenup", "", 1, 0, nil)
	e := testkit.NewEngine(t, d.Pool, engineConfig(d), def)
	ctx := context.Background()

	// A start first, so that the engine has whatever it keeps warm.
	_, err := saga.Start(ctx, e, def, order{Key: "warm"}, nil)
	require.NoError(t, err)

	var conns []interface{ Release() }
	for i := 0; i < int(d.Pool.Config().MaxConns); i++ {
		c, err := d.Pool.Acquire(ctx)
		require.NoError(t, err)
		conns = append(conns, c)
	}
	id := uuid.New()
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	t0 := time.Now()
	_, err = saga.Start(short, e, def, order{Key: "late"}, &saga.StartOpts{ID: id, BusinessKey: "late"})
	took := time.Since(t0)
	cancel()
	t.Logf("start with every connection taken returned after %s: %v", took.Round(time.Millisecond), err)
	require.Error(t, err)
	require.True(t, isCtxErr(err), "the error says the context ended: %v", err)
	require.Less(t, took, 2*time.Second, "the start returns when its context ends")

	for _, c := range conns {
		c.Release()
	}
	time.Sleep(time.Second)
	_, gerr := e.Get(ctx, id)
	require.ErrorIs(t, gerr, saga.ErrNotFound, "a start that returned %q (its context ended while it waited for a connection) started its saga after the caller gave up (F5)", err)
	require.ErrorContains(t, err, "nothing was started")
}
