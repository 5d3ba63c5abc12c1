package sagatest

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/fault"
	"github.com/sagaflow/sagaflow/saga"
)

// Boundary is a commit boundary of the engine: a moment in a step's life at
// which [CrashMatrix] crashes it. The names are stable, and the same as the
// crash points of sagaflow's own crash-point matrix.
type Boundary string

// The boundaries.
const (
	// AfterClaim: a worker's transaction has claimed commands and locked
	// their sagas; no step's handler has run.
	AfterClaim Boundary = "engine.after-claim"
	// AfterHandler: a step's handler returned; its writes are in the step's
	// transaction, which is not committed; its outcome is not written yet.
	// Only steps with an Action or a Compensate function cross it.
	AfterHandler Boundary = "engine.after-handler"
	// BeforeCommit: the batch's steps and outcomes are written; COMMIT is
	// next.
	BeforeCommit Boundary = "engine.before-commit"
	// AfterCommit: the batch committed; in Kafka mode, the command's offset
	// is not committed yet.
	AfterCommit Boundary = "engine.after-commit"
	// AfterHold: in Kafka mode, a command whose saga was busy was moved back
	// to the outbox (committed); its offset is not committed yet. Sagas cross
	// it only when commands meet a busy saga, so it is not among the
	// defaults of [CrashOpts].Boundaries.
	AfterHold Boundary = "engine.after-hold"
)

// Round names one round of [CrashMatrix]: the boundary it crashes at and
// the crossing of it at which it crashes. The zero Round is the round
// without a crash.
type Round struct {
	Boundary Boundary
	Crossing int
}

// String names the round, for business data and logs: "no-crash", or the
// boundary and the crossing, as "engine.after-handler.12". Each round of a
// matrix has a name of its own.
func (r Round) String() string {
	if r.Boundary == "" {
		return "no-crash"
	}
	return fmt.Sprintf("%s.%d", r.Boundary, r.Crossing)
}

// Defaults of [CrashOpts].
const (
	// CrashSagasDefault is how many sagas each round of the matrix starts.
	CrashSagasDefault = 8
)

// Effect names the writes of one step's handler: its Action's (or, for a
// remote step, the participant's handler of its command), or, with
// Compensation, its compensation's.
type Effect struct {
	Step         string
	Compensation bool
}

// String names e as a failure message does: "step charge" or
// "compensation of charge".
func (e Effect) String() string {
	if e.Compensation {
		return "compensation of " + e.Step
	}
	return "step " + e.Step
}

// CrashOpts configure [CrashMatrix]. Start and Effects are required.
type CrashOpts struct {
	// Config configures the engines the matrix starts, as your service's
	// engine: Schema, and Kafka for the Kafka mode (then the schema's relay,
	// and the participants of remote steps, must run while the matrix runs).
	// nil means the defaults.
	Config *saga.Config
	// Sagas is how many sagas each round starts. Defaults to
	// CrashSagasDefault.
	Sagas int
	// Start starts saga i (0 ≤ i < Sagas) of round r with saga.Start or
	// saga.StartTx on e, and returns its ID. Saga i must end the same way
	// in every round (completed, compensated or failed): the matrix
	// compares each round with the round without a crash. Give each saga
	// its own business data, made of r's name and i (an order ID such as
	// fmt.Sprintf("%s-%d", r, i), say), so that rounds do not meet.
	Start func(ctx context.Context, e *saga.Engine, r Round, i int) (uuid.UUID, error)
	// Effects counts, in the database, the writes of saga in's handlers,
	// by step: for each Effect, how many times its writes are there (rows
	// a step inserted with run.Tx, a participant's rows for a remote step).
	// Give a count for every effect to check, zeros included: an effect
	// missing from the map is not checked. Each count must equal the
	// number of times the saga's timeline says the step (or its
	// compensation) completed: more is an effect doubled, fewer an effect
	// lost.
	Effects func(ctx context.Context, in *saga.Instance) (map[Effect]int, error)
	// Boundaries are where to crash, one round each. Defaults to
	// AfterClaim, AfterHandler, BeforeCommit, AfterCommit.
	Boundaries []Boundary
	// Crossings are the crossings of each boundary, counted from the
	// engine's start, at which to crash, one round each. A boundary is
	// crossed once per step (AfterHandler) or per batch of steps (the
	// others). By default two rounds per boundary: at its first crossing,
	// which falls among the sagas' first steps, and at the crossing three
	// quarters of the way through the crossings that the round without a
	// crash made, among their later steps (not the last one: a boundary
	// crossed per batch is crossed a different number of times from round
	// to round, and a round that ends before its crossing crashes nothing).
	Crossings []int
	// EveryCrossing crashes at every crossing of each boundary that the
	// round without a crash made, one round each, instead of Crossings: the
	// thorough matrix, as many rounds as there are crossings.
	EveryCrossing bool
	// Timeout is how long the sagas of a round have to end, before and
	// after the crash. Defaults to WaitTimeoutDefault.
	Timeout time.Duration
}

// CrashMatrix runs your saga def with a crash at each of the engine's commit
// boundaries, and fails tb unless every saga ends, each effect is in the
// database exactly as often as the saga's timeline says its step completed
// (0 lost, 0 doubled), compensations included, and each saga ends as it
// does without a crash.
//
// It first runs a round without a crash, then, for each boundary, one round
// per crossing of [CrashOpts].Crossings (by default two: the first crossing
// and one three quarters of the way), as subtests named after the
// boundaries and the crossings ("engine.after-handler/crossing-12") when tb
// is a *testing.T. A round starts [CrashOpts].Sagas sagas with Start, then
// an engine, whose process "dies" at the round's crossing of the boundary
// (the n-th time one of its workers reaches it):
// that worker and every other one that reaches a boundary after it stop
// there for good, the engine's connections to PostgreSQL are terminated
// (pg_terminate_backend, as the pool's role; what was not committed is
// rolled back, as when a process dies), and the engine is stopped. Then a new engine starts on the same schema, as a
// restarted service would, every saga must end within Timeout, and Effects
// counts what each one did. A boundary that the sagas never crossed often
// enough is reported (the subtest is skipped): nothing was crashed there.
//
// The crash needs no build tag: it is reached through the context of the
// engine's Start, which only sagatest can give a crash to. Crashing an
// engine makes it log connection errors; the crashed engine's log is
// discarded. The engines run in this process, on their own connections;
// pool is used for Start, for reading the sagas and for the restarted
// engines.
func CrashMatrix(tb testing.TB, pool *pgxpool.Pool, def saga.AnyDefinition, opts *CrashOpts) {
	tb.Helper()
	m, err := newMatrix(pool, def, opts)
	if err != nil {
		tb.Fatalf("sagatest: crash matrix: %v", err)
		return
	}
	var base *outcome
	if !m.run(tb, "no-crash", func(tb testing.TB) bool {
		base = m.round(tb, Round{}, nil)
		return true
	}) || base == nil {
		tb.Errorf("sagatest: crash matrix of saga %s: the round without a crash failed; no crash was tried", def.Name())
		return
	}
	for _, b := range m.o.Boundaries {
		crossings := m.crossings(base.crossings[string(b)])
		if len(crossings) == 0 {
			m.run(tb, string(b), func(tb testing.TB) bool {
				tb.Logf("sagatest: crash matrix of saga %s: its sagas never cross boundary %s: nothing to crash there", m.def.Name(), b)
				return false
			})
			continue
		}
		m.run(tb, string(b), func(tb testing.TB) bool {
			crashed := false
			for _, c := range crossings {
				m.run(tb, fmt.Sprintf("crossing-%d", c), func(tb testing.TB) bool {
					out := m.round(tb, Round{Boundary: b, Crossing: c}, base)
					crashed = crashed || out != nil
					return out != nil
				})
			}
			return crashed
		})
	}
}

// crossings lists the crossings of a boundary to crash at, given that the
// round without a crash crossed it n times.
func (m *matrix) crossings(n int) []int {
	switch {
	case len(m.o.Crossings) > 0:
		return m.o.Crossings
	case n == 0:
		return nil
	case m.o.EveryCrossing:
		out := make([]int, n)
		for i := range out {
			out[i] = i + 1
		}
		return out
	}
	late := (3*n + 3) / 4
	if late <= 1 {
		return []int{1}
	}
	return []int{1, late}
}

// outcome is what a round saw: how each saga ended and, in the round
// without a crash, how many times each boundary was crossed.
type outcome struct {
	statuses  []saga.Status
	crossings map[string]int
}

type matrix struct {
	pool   *pgxpool.Pool
	def    saga.AnyDefinition
	o      CrashOpts
	client *saga.Engine // never started: starts and reads sagas
}

func newMatrix(pool *pgxpool.Pool, def saga.AnyDefinition, opts *CrashOpts) (*matrix, error) {
	var missing []string
	for what, ok := range map[string]bool{"pool": pool != nil, "definition": def != nil, "opts": opts != nil,
		"CrashOpts.Start": opts != nil && opts.Start != nil, "CrashOpts.Effects": opts != nil && opts.Effects != nil} {
		if !ok {
			missing = append(missing, what)
		}
	}
	if len(missing) > 0 {
		slices.Sort(missing)
		return nil, fmt.Errorf("%s: required, and nil", strings.Join(missing, ", "))
	}
	o := *opts
	if o.Config == nil {
		o.Config = &saga.Config{}
	}
	if o.Sagas <= 0 {
		o.Sagas = CrashSagasDefault
	}
	if len(o.Boundaries) == 0 {
		o.Boundaries = []Boundary{AfterClaim, AfterHandler, BeforeCommit, AfterCommit}
	}
	for _, b := range o.Boundaries {
		if !slices.Contains([]Boundary{AfterClaim, AfterHandler, BeforeCommit, AfterCommit, AfterHold}, b) {
			return nil, fmt.Errorf("CrashOpts.Boundaries: unknown boundary %q", b)
		}
	}
	for _, c := range o.Crossings {
		if c <= 0 {
			return nil, fmt.Errorf("CrashOpts.Crossings: %d: a crossing is counted from 1", c)
		}
	}
	if o.Timeout <= 0 {
		o.Timeout = WaitTimeoutDefault
	}
	m := &matrix{pool: pool, def: def, o: o}
	client, err := m.engine(pool, nil)
	if err != nil {
		return nil, err
	}
	m.client = client
	return m, nil
}

// run runs f as the subtest name when tb is a *testing.T, and skips the
// subtest when f reports that it crashed nothing; otherwise it runs f with
// tb. It reports whether f passed.
func (m *matrix) run(tb testing.TB, name string, f func(tb testing.TB) bool) bool {
	if t, ok := tb.(*testing.T); ok {
		return t.Run(name, func(t *testing.T) {
			if !f(t) && !t.Failed() {
				t.SkipNow()
			}
		})
	}
	f(tb)
	return !tb.Failed()
}

// engine makes an engine for the matrix's saga on pool; a nil log keeps the
// configuration's logger.
func (m *matrix) engine(pool *pgxpool.Pool, log *slog.Logger) (*saga.Engine, error) {
	cfg := *m.o.Config
	if cfg.Kafka != nil {
		k := *cfg.Kafka
		cfg.Kafka = &k
	}
	if log != nil {
		cfg.Logger = log
	}
	e, err := saga.New(pool, &cfg)
	if err != nil {
		return nil, err
	}
	if err := e.Register(m.def); err != nil {
		return nil, err
	}
	return e, nil
}

// round runs round r: without a crash (and counting the crossings of each
// boundary) when r is the zero Round. It returns what it saw, or nil when
// the round could not be run or crashed nothing.
func (m *matrix) round(tb testing.TB, r Round, base *outcome) *outcome {
	tb.Helper()
	ctx := context.Background()
	b := r.Boundary
	name := "the round without a crash"
	if b != "" {
		name = fmt.Sprintf("boundary %s, crossing %d", b, r.Crossing)
	}
	fail := func(format string, args ...any) *outcome {
		tb.Errorf("sagatest: crash matrix of saga %s, %s: %s", m.def.Name(), name, fmt.Sprintf(format, args...))
		return nil
	}
	c := &crasher{at: b, seen: map[string]int{}, crashed: make(chan struct{}), dead: make(chan struct{})}
	c.crossing = r.Crossing
	ids := make([]uuid.UUID, m.o.Sagas)
	for i := range ids {
		id, err := m.o.Start(ctx, m.client, r, i)
		if err != nil {
			return fail("start saga %d: %v", i, err)
		}
		if id == uuid.Nil {
			return fail("start saga %d: Start returned no saga ID", i)
		}
		ids[i] = id
	}
	began := time.Now()
	pool, pids := m.pool, &pidSet{}
	var log *slog.Logger
	if b != "" {
		// The engine to crash has connections of its own, to terminate.
		cfg := m.pool.Config()
		afterConnect := cfg.AfterConnect
		cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
			pids.add(conn.PgConn().PID())
			if afterConnect != nil {
				return afterConnect(ctx, conn)
			}
			return nil
		}
		p, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			return fail("open the connections of the engine to crash: %v", err)
		}
		defer p.Close()
		pool, log = p, slog.New(slog.DiscardHandler)
	}
	e, err := m.engine(pool, log)
	if err != nil {
		return fail("%v", err)
	}
	runCtx, cancelRun := context.WithCancel(fault.WithHook(ctx, c.hook))
	defer cancelRun()
	if err := e.Start(runCtx); err != nil {
		return fail("start the engine: %v", err)
	}
	stop := func(e *saga.Engine, hard bool) {
		sctx, cancel := context.WithTimeout(ctx, m.o.Timeout)
		defer cancel()
		stop := e.Stop
		if hard {
			stop = e.StopAndCancel
		}
		if err := stop(sctx); err != nil {
			tb.Errorf("sagatest: crash matrix of saga %s, %s: stop the engine: %v", m.def.Name(), name, err)
		}
	}
	stopped := false
	defer func() {
		if !stopped {
			c.kill() // let frozen workers go, so that the engine stops
			stop(e, b != "")
		}
	}()

	ended, hit, err := m.waitAll(ctx, ids, c.crashed)
	if err != nil {
		return fail("%v", err)
	}
	restart := ""
	if hit {
		// The process dies: its connections go, then its goroutines.
		if err := m.terminate(ctx, pids.list()); err != nil {
			return fail("crash: %v", err)
		}
		c.kill()
		cancelRun()
		stop(e, true)
		stopped = true
		e2, err := m.engine(m.pool, nil)
		if err != nil {
			return fail("restart: %v", err)
		}
		if err := e2.Start(ctx); err != nil {
			return fail("restart: start the engine: %v", err)
		}
		defer stop(e2, false)
		restart = fmt.Sprintf("crashed at crossing %d of %s after %s, restarted; ", c.crossing, b, time.Since(began).Round(time.Millisecond))
		if ended, _, err = m.waitAll(ctx, ids, nil); err != nil {
			return fail("%v", err)
		}
	}
	var statuses []saga.Status
	if base != nil {
		statuses = base.statuses
	}
	out := &outcome{statuses: m.check(tb, name, ids, ended, statuses), crossings: c.crossings()}
	tb.Logf("sagatest: crash matrix of saga %s, %s: %s%s", m.def.Name(), name, restart, summary(ended, time.Since(began)))
	if b != "" && !hit {
		tb.Logf("sagatest: crash matrix of saga %s: the sagas crossed boundary %s %d times, fewer than the %d at which it was to crash: nothing was crashed there",
			m.def.Name(), b, out.crossings[string(b)], c.crossing)
		return nil
	}
	return out
}

// waitAll reads the sagas until every one has ended, Timeout passes, or
// crashed is closed (then it reports hit). It returns the sagas as last
// read.
func (m *matrix) waitAll(ctx context.Context, ids []uuid.UUID, crashed <-chan struct{}) (ended []*saga.Instance, hit bool, err error) {
	ended = make([]*saga.Instance, len(ids))
	deadline := time.NewTimer(m.o.Timeout)
	defer deadline.Stop()
	tick := time.NewTicker(WaitPollDefault)
	defer tick.Stop()
	for {
		all := true
		for i, id := range ids {
			if ended[i] != nil && ended[i].Status.Terminal() {
				continue
			}
			in, err := m.client.Get(ctx, id)
			if err != nil {
				return nil, false, fmt.Errorf("read saga %d (%s): %w", i, id, err)
			}
			ended[i] = in
			all = all && in.Status.Terminal()
		}
		if all {
			return ended, false, nil
		}
		select {
		case <-crashed:
			return ended, true, nil
		case <-deadline.C:
			return ended, false, nil // the stuck sagas are reported by check
		case <-tick.C:
		}
	}
}

// terminate ends the server side of the crashed engine's connections.
func (m *matrix) terminate(ctx context.Context, pids []int32) error {
	_, err := m.pool.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM unnest($1::int4[]) AS t(pid)", pids)
	if err != nil {
		return fmt.Errorf("terminate the engine's connections: %w", err)
	}
	return nil
}

// check compares what each saga did with what it should have done, fails
// tb with every difference, and returns how the sagas ended.
func (m *matrix) check(tb testing.TB, name string, ids []uuid.UUID, ended []*saga.Instance, baseline []saga.Status) []saga.Status {
	tb.Helper()
	ctx := context.Background()
	statuses := make([]saga.Status, len(ids))
	var stuck, lost, doubled, other int
	var report strings.Builder
	for i, in := range ended {
		statuses[i] = in.Status
		if !in.Status.Terminal() {
			stuck++
			fmt.Fprintf(&report, "saga %d (%s) is stuck: it did not end within %s\n%s", i, ids[i], m.o.Timeout, Describe(in))
			continue
		}
		var why []string
		if baseline != nil && in.Status != baseline[i] {
			other++
			why = append(why, fmt.Sprintf("it ended %s, and %s without a crash", in.Status, baseline[i]))
		}
		got, err := m.o.Effects(ctx, in)
		if err != nil {
			tb.Errorf("sagatest: crash matrix of saga %s, %s: count the effects of saga %d (%s): %v", m.def.Name(), name, i, ids[i], err)
			continue
		}
		want := completions(in)
		for _, e := range slices.SortedFunc(maps.Keys(got), func(a, b Effect) int { return strings.Compare(a.String(), b.String()) }) {
			switch n, w := got[e], want[e]; {
			case n > w:
				doubled++
				why = append(why, fmt.Sprintf("%s: its effects are there %s, but it completed %s (doubled)", e, times(n), times(w)))
			case n < w:
				lost++
				why = append(why, fmt.Sprintf("%s: its effects are there %s, but it completed %s (lost)", e, times(n), times(w)))
			}
		}
		if len(why) > 0 {
			fmt.Fprintf(&report, "saga %d (%s): %s\n%s", i, ids[i], strings.Join(why, "; "), Describe(in))
		}
	}
	if report.Len() > 0 {
		tb.Errorf("sagatest: crash matrix of saga %s, %s: %d stuck, %d lost, %d doubled, %d ended otherwise than without a crash:\n%s",
			m.def.Name(), name, stuck, lost, doubled, other, report.String())
	}
	return statuses
}

// completions counts, from the saga's timeline, how many times each step
// and each compensation completed.
func completions(in *saga.Instance) map[Effect]int {
	n := map[Effect]int{}
	for _, ev := range in.History {
		switch ev.Type {
		case saga.EventStepCompleted:
			n[Effect{Step: ev.Step}]++
		case saga.EventCompensationCompleted:
			n[Effect{Step: ev.Step, Compensation: true}]++
		}
	}
	return n
}

// summary says how the sagas of a round ended.
func summary(ended []*saga.Instance, took time.Duration) string {
	by := map[saga.Status]int{}
	for _, in := range ended {
		by[in.Status]++
	}
	stuck := len(ended) - by[saga.StatusCompleted] - by[saga.StatusCompensated] - by[saga.StatusFailed]
	return fmt.Sprintf("%d sagas: %d completed, %d compensated, %d failed, %d stuck, in %s", len(ended),
		by[saga.StatusCompleted], by[saga.StatusCompensated], by[saga.StatusFailed], stuck, took.Round(time.Millisecond))
}

// crasher is the crash of one engine: the hook its workers call at every
// boundary they reach. It counts the crossings of every boundary, and
// crashes at the crossing-th of boundary at, unless at is "".
type crasher struct {
	at       Boundary
	crossing int
	crashed  chan struct{} // closed when a worker reaches the boundary for the crossing-th time
	dead     chan struct{} // closed by kill: the frozen workers end

	mu       sync.Mutex
	seen     map[string]int
	fired    bool
	killOnce sync.Once
}

// hook counts the crossing; from the crash on, every worker that reaches a
// boundary stops there and, once killed, ends without going on: its
// transaction is never committed.
func (c *crasher) hook(point string) {
	c.mu.Lock()
	if !c.fired {
		c.seen[point]++
		if c.at == "" || point != string(c.at) || c.seen[point] < c.crossing {
			c.mu.Unlock()
			return
		}
		c.fired = true
		close(c.crashed)
	}
	c.mu.Unlock()
	<-c.dead
	runtime.Goexit()
}

func (c *crasher) kill() { c.killOnce.Do(func() { close(c.dead) }) }

func (c *crasher) crossings() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.seen)
}

// pidSet holds the server process IDs of a pool's connections.
type pidSet struct {
	mu   sync.Mutex
	pids []int32
}

func (s *pidSet) add(pid uint32) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pids = append(s.pids, int32(pid))
}

func (s *pidSet) list() []int32 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.pids)
}

// times says "once", "twice" or "n times".
func times(n int) string {
	switch n {
	case 1:
		return "once"
	case 2:
		return "twice"
	}
	return fmt.Sprintf("%d times", n)
}
