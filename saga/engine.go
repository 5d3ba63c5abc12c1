package saga

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/internal/lifecycle"
	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/signing"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/internal/telemetry"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/outbox"
)

// Configuration defaults.
const (
	// WorkersDefault is the number of executor goroutines per engine.
	WorkersDefault = 4
	// BatchSizeDefault is how many commands a worker claims and runs in one
	// transaction.
	BatchSizeDefault = 16
	// BatchSizeMax bounds BatchSize: each step in a batch runs under its own
	// savepoint, and PostgreSQL slows down once a transaction has more than
	// 64 subtransactions.
	BatchSizeMax = 32
	// PollIntervalDefault is how often idle workers look for due commands
	// when no notification wakes them.
	PollIntervalDefault = time.Second
	// MaxStateBytesDefault bounds a saga's encoded state.
	MaxStateBytesDefault = 1 << 20
	// MaxCommandBytesDefault bounds a remote step's command payload: room
	// for its key and headers under the relay's default MaxMessageBytes
	// (1 MiB), which parks a larger message.
	MaxCommandBytesDefault = 1<<20 - 16<<10
	// CommandTopicDefault names the outbox topic of step commands.
	CommandTopicDefault = "sagaflow.commands"
	// RescueSlackDefault is added to every step's deadline before a saga
	// counts as stuck.
	RescueSlackDefault = time.Minute
	// HandlerGraceDefault is how long a handler may run past its timeout
	// before its worker gives up on it and closes its connection.
	HandlerGraceDefault = 10 * time.Second
	// ReplyStepLimitDefault is how long the step run at once after a reply
	// may hold its Kafka reply worker (see KafkaConfig.ReplyStepLimit).
	ReplyStepLimitDefault = 200 * time.Millisecond
	// UnknownSagaGraceDefault is how long a command for a saga or step this
	// engine does not know waits for an engine that knows it.
	UnknownSagaGraceDefault = 10 * time.Minute
	// RescueIntervalDefault is how often the stuck-saga rescuer runs.
	RescueIntervalDefault = 30 * time.Second
	// RescueBatchDefault is how many stuck sagas one rescue transaction
	// handles.
	RescueBatchDefault = 100
	// RetentionIntervalDefault is how often retention runs.
	RetentionIntervalDefault = time.Hour
	// RetentionBatchDefault is how many rows one retention statement deletes.
	RetentionBatchDefault = 1000
	// OutboxRetentionDefault is how long published messages are kept: the
	// window in which they can be replayed.
	OutboxRetentionDefault = 7 * 24 * time.Hour
	// InboxRetentionDefault is how long processed keys are kept; it must be
	// longer than the outbox retention.
	InboxRetentionDefault = 14 * 24 * time.Hour
	// SagaRetentionDefault is how long completed and compensated sagas and
	// their history are kept.
	SagaRetentionDefault = 30 * 24 * time.Hour
)

// Config configures an [Engine]. The zero value is valid; zero fields take
// their defaults.
type Config struct {
	// Schema holds sagaflow's tables. Defaults to migrations.SchemaDefault
	// ("sagaflow").
	Schema string
	// Workers is the number of goroutines that claim and run steps after
	// [Engine.Start]. Defaults to WorkersDefault.
	Workers int
	// BatchSize is how many commands a worker runs per transaction: one
	// commit for the batch, one savepoint per step. Defaults to
	// BatchSizeDefault; at most BatchSizeMax.
	BatchSize int
	// PollInterval is the longest an idle worker waits before looking for
	// due commands; notifications usually wake it sooner. Defaults to
	// PollIntervalDefault.
	PollInterval time.Duration
	// MaxStateBytes bounds a saga's JSON-encoded state, at start and after
	// each step. Defaults to MaxStateBytesDefault (1 MiB).
	MaxStateBytes int
	// MaxCommandBytes bounds the payload a remote step's Command (or
	// CompensateCommand), or a remote branch's, encodes to: a larger one
	// fails the step (or the branch's group) for good
	// with code payload_too_large, naming its size, instead of reaching the
	// outbox, where the relay would park it and the saga would wait its
	// Timeout for a reply that cannot come. Keep it under the relay's
	// MaxMessageBytes, which counts the key and headers too. Defaults to
	// MaxCommandBytesDefault.
	MaxCommandBytes int
	// CommandTopic is the outbox topic of step commands (in Kafka mode,
	// the prefix of one topic per saga type). Defaults to
	// CommandTopicDefault. In Kafka mode, give each schema that shares a
	// cluster its own: engines of different schemas are different consumer
	// groups, and each would also read, and dead-letter, the other's
	// commands.
	CommandTopic string
	// RescueSlack is added to each step's timeout to give a saga's deadline,
	// past which the rescuer looks at it. When a step has
	// to move the deadline, it moves it with RescueSlack more as room, so
	// that quick steps after it can leave it where it is; a new saga's first
	// deadline has that room too. A lost command is so found at most the
	// step's Timeout plus twice RescueSlack after it was written. A new
	// saga's first deadline is set by the engine that starts it, with its
	// own RescueSlack. Defaults to RescueSlackDefault.
	RescueSlack time.Duration
	// HandlerGrace is how long a handler that ignores its cancelled context
	// may keep its worker before the worker abandons it and closes the
	// transaction's connection. Defaults to HandlerGraceDefault.
	HandlerGrace time.Duration
	// UnknownSagaGrace is how long a command for a saga or a step that this
	// engine does not know is left for other engines (during a rolling
	// deploy, say) before it is parked as dead with the reason. Defaults to
	// UnknownSagaGraceDefault.
	UnknownSagaGrace time.Duration
	// RescueInterval is how often the stuck-saga rescuer looks for sagas
	// past their deadline. At least a second (cron's resolution). Defaults
	// to RescueIntervalDefault.
	RescueInterval time.Duration
	// RescueBatch bounds the sagas one rescue transaction handles. Defaults
	// to RescueBatchDefault.
	RescueBatch int
	// RetentionInterval is how often old rows are deleted. At least a
	// second. Defaults to RetentionIntervalDefault.
	RetentionInterval time.Duration
	// RetentionBatch bounds the rows one retention statement deletes.
	// Defaults to RetentionBatchDefault.
	RetentionBatch int
	// OutboxRetention is how long published messages are kept, and so how
	// far back outbox replay reaches. Defaults to OutboxRetentionDefault.
	OutboxRetention time.Duration
	// InboxRetention is how long processed keys are kept. It must be longer
	// than OutboxRetention: a replayed message whose key had already left
	// the inbox would be processed twice. Defaults to InboxRetentionDefault.
	InboxRetention time.Duration
	// SagaRetention is how long completed and compensated sagas, with their
	// history, are kept after they ended. Failed sagas are kept until an
	// operator deals with them. Defaults to SagaRetentionDefault.
	SagaRetention time.Duration
	// Kafka, when set, carries step commands over Kafka (see [KafkaConfig]);
	// nil runs them straight from the outbox table (the Postgres-only mode).
	Kafka *KafkaConfig
	// Location is the time zone of cron specs given to [Schedule]. Defaults
	// to UTC.
	Location *time.Location
	// Logger receives the engine's logs. Defaults to slog.Default().
	// Records logged with a context that carries a span get its trace_id
	// and span_id.
	Logger *slog.Logger
	// TracerProvider makes the engine's spans: one per saga start and per
	// step attempt (see docs/observability.md). Defaults to OpenTelemetry's
	// global provider (otel.GetTracerProvider), which records nothing
	// until the application sets one.
	TracerProvider trace.TracerProvider
	// MeterProvider makes the engine's metrics. Defaults to
	// OpenTelemetry's global provider (otel.GetMeterProvider).
	MeterProvider metric.MeterProvider
	// SagaGaugeInterval is the least time between two of the queries
	// behind the sagaflow.sagas gauge (sagas by name and status). Defaults
	// to SagaGaugeIntervalDefault.
	SagaGaugeInterval time.Duration
}

func (c *Config) withDefaults() (Config, error) {
	out := Config{}
	if c != nil {
		out = *c
	}
	if out.Schema == "" {
		out.Schema = store.SchemaDefault
	}
	if err := store.ValidateSchema(out.Schema); err != nil {
		return out, fmt.Errorf("%w: Schema: %w", ErrInvalidConfig, err)
	}
	type check struct {
		bad  bool
		what string
	}
	for _, ch := range []check{
		{out.Workers < 0, "Workers must not be negative"},
		{out.BatchSize < 0 || out.BatchSize > BatchSizeMax, fmt.Sprintf("BatchSize must be between 1 and %d", BatchSizeMax)},
		{out.PollInterval < 0, "PollInterval must not be negative"},
		{out.MaxStateBytes < 0, "MaxStateBytes must not be negative"},
		{out.MaxCommandBytes < 0, "MaxCommandBytes must not be negative"},
		{out.RescueSlack < 0, "RescueSlack must not be negative"},
		{out.HandlerGrace < 0, "HandlerGrace must not be negative"},
		{out.UnknownSagaGrace < 0, "UnknownSagaGrace must not be negative"},
		{out.RescueInterval != 0 && out.RescueInterval < time.Second, "RescueInterval must be at least 1s"},
		{out.RescueBatch < 0, "RescueBatch must not be negative"},
		{out.RetentionInterval != 0 && out.RetentionInterval < time.Second, "RetentionInterval must be at least 1s"},
		{out.RetentionBatch < 0, "RetentionBatch must not be negative"},
		{out.OutboxRetention < 0 || out.InboxRetention < 0 || out.SagaRetention < 0, "retention windows must not be negative"},
		{out.SagaGaugeInterval < 0, "SagaGaugeInterval must not be negative"},
	} {
		if ch.bad {
			return out, fmt.Errorf("%w: %s", ErrInvalidConfig, ch.what)
		}
	}
	if out.Workers == 0 {
		out.Workers = WorkersDefault
	}
	if out.SagaGaugeInterval == 0 {
		out.SagaGaugeInterval = SagaGaugeIntervalDefault
	}
	if out.BatchSize == 0 {
		out.BatchSize = BatchSizeDefault
	}
	if out.PollInterval == 0 {
		out.PollInterval = PollIntervalDefault
	}
	if out.MaxStateBytes == 0 {
		out.MaxStateBytes = MaxStateBytesDefault
	}
	if out.MaxCommandBytes == 0 {
		out.MaxCommandBytes = MaxCommandBytesDefault
	}
	if out.CommandTopic == "" {
		out.CommandTopic = CommandTopicDefault
	}
	if out.RescueSlack == 0 {
		out.RescueSlack = RescueSlackDefault
	}
	if out.HandlerGrace == 0 {
		out.HandlerGrace = HandlerGraceDefault
	}
	if out.UnknownSagaGrace == 0 {
		out.UnknownSagaGrace = UnknownSagaGraceDefault
	}
	setDefault(&out.RescueInterval, RescueIntervalDefault)
	setDefault(&out.RescueBatch, RescueBatchDefault)
	setDefault(&out.RetentionInterval, RetentionIntervalDefault)
	setDefault(&out.RetentionBatch, RetentionBatchDefault)
	setDefault(&out.OutboxRetention, OutboxRetentionDefault)
	setDefault(&out.InboxRetention, InboxRetentionDefault)
	setDefault(&out.SagaRetention, SagaRetentionDefault)
	if out.InboxRetention <= out.OutboxRetention {
		return out, fmt.Errorf("%w: InboxRetention (%s) must be longer than OutboxRetention (%s), the replay window: "+
			"a replayed message whose key had already left the inbox would be processed twice",
			ErrInvalidConfig, out.InboxRetention, out.OutboxRetention)
	}
	if out.Location == nil {
		out.Location = time.UTC
	}
	if out.Kafka != nil {
		k := *out.Kafka
		if len(k.Brokers) == 0 && k.NewReader == nil {
			return out, fmt.Errorf("%w: Kafka.Brokers is empty and Kafka.NewReader is not set: set Brokers, or NewReader to consume through another client or transport", ErrInvalidConfig)
		}
		if k.GroupID == "" {
			k.GroupID = "sagaflow-engine-" + out.Schema
		}
		if k.SessionTimeout < 0 || (k.SessionTimeout > 0 && k.SessionTimeout < time.Second) {
			return out, fmt.Errorf("%w: Kafka.SessionTimeout %s: want 0 (the default) or at least 1s", ErrInvalidConfig, k.SessionTimeout)
		}
		if k.SessionTimeout >= math.MaxInt32*time.Millisecond {
			// The Kafka protocol carries it in int32 milliseconds; kafka-go
			// panicked at Start (review31 F3).
			return out, fmt.Errorf("%w: Kafka.SessionTimeout %s: want less than 2^31 ms (about 24.8 days; a broker allows 30 min by default)",
				ErrInvalidConfig, k.SessionTimeout)
		}
		if k.ReplyStepLimit == 0 {
			k.ReplyStepLimit = ReplyStepLimitDefault
		}
		if len(k.VerifyKeys) > 0 && len(k.SigningKey) == 0 {
			return out, fmt.Errorf("%w: Kafka.VerifyKeys is set but Kafka.SigningKey is not: set the current key too", ErrInvalidConfig)
		}
		out.Kafka = &k
	}
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	return out, nil
}

func setDefault[T comparable](v *T, def T) {
	var zero T
	if *v == zero {
		*v = def
	}
}

// Engine runs sagas. It starts sagas, reads and steers them, and, between
// [Engine.Start] and [Engine.Stop], executes their steps. An engine that is
// never started is a client: it can start, read and cancel sagas that other
// engines run.
type Engine struct {
	pool *pgxpool.Pool
	cfg  Config
	st   *store.Store
	// outbox serves the operator's outbox calls.
	outbox *outbox.Outbox
	log    *slog.Logger
	// unaddressed holds the remote steps ("<saga>/<step>") whose refusals
	// named no command, each warned about once (see batch.reply).
	unaddressed sync.Map
	// unchain holds the sagas whose step, run at once after a reply or a
	// wait's end, was abandoned: their next such step is not run at once,
	// so that its attempts count (see [batch.mayChain]). Only an
	// abandonment, which also costs a connection, adds one.
	unchain sync.Map
	// recording holds the sagas whose abandoned attempt is being recorded
	// (see [Engine.abandon]); their commands wait.
	recording sync.Map
	// handOff holds the steps ([stepRef]) that ran past
	// KafkaConfig.ReplyStepLimit after a reply, each until the time it is
	// run at once after a reply again (see [batch.handsOff]).
	handOff sync.Map

	// machine makes the sagas' decisions (see machine.go).
	machine machine

	// defs is the snapshot of the registered definitions. It never
	// changes: Register replaces it, under mu, until the first Start
	// freezes it; readers load it without a lock.
	defs atomic.Pointer[registry]

	mu        sync.Mutex
	schedules []schedule // from Schedule, started with the engine
	frozen    bool       // set at the first Start: definitions no longer change

	life lifecycle.Lifecycle
	// wakeLocal wakes this engine's direct workers once it has started in
	// Postgres-only mode; nil otherwise.
	wakeLocal atomic.Pointer[func()]
	// wakesDue counts the wake-ups set for commands this engine wrote for
	// later that have not fired yet (see [Engine.wakeIn]).
	wakesDue atomic.Int64
	notifier notifier
	starts   *startGroup // starts on the pool, committed together (startgroup.go)

	stats statCounters
	hooks testHooks
	// tel is the engine's tracer and instruments (see telemetry.go).
	tel *engineTelemetry
	// hstate is what the goroutines tell Health (see health.go).
	hstate healthState
	// running are the steps whose handlers run now, by saga, for cancel
	// requests to interrupt.
	running runningSteps
	// pausesHeard counts the pause notifications heard: a batch that hears
	// one after it began looks at the pauses again before each step.
	pausesHeard atomic.Int64
	// signer signs the commands written for Kafka and verifies what is
	// consumed; off unless Kafka.SigningKey is set.
	signer signing.Keys
}

// testHooks let tests stop a batch at chosen points.
type testHooks struct {
	// beforeCommit runs after a batch's steps and before its commit; an error
	// aborts the batch as a crash would.
	beforeCommit func(ctx context.Context, tx pgx.Tx) error
	// beforeRescueUpdate runs between the rescuer's read of a stuck saga
	// and its guarded update.
	beforeRescueUpdate func(sg *store.Saga)
	// outcome may change a step's transition before it is queued, to make
	// PostgreSQL refuse it.
	outcome func(tr *store.Transition)
	// beforeRecordAbandoned runs after an abandoned attempt's connection
	// was closed and before the attempt is recorded.
	beforeRecordAbandoned func(sagaID uuid.UUID)
	// idle runs when a direct worker is done with its batches, before it
	// looks for the next due command.
	idle func()
	// readAhead runs after a batch of Kafka messages read their sagas
	// together (see [Engine.prefetchSagas]), with the sagas it found, and
	// before any of the messages runs.
	readAhead func(ids []uuid.UUID)
	// cancelRead runs when an operator's cancel has read a saga and won its
	// execution lock, before the fenced update that applies the cancel.
	cancelRead func(id uuid.UUID)
}

// New returns an engine on pool. A nil cfg means the defaults. The schema must
// have been migrated with migrations.Migrate.
func New(pool *pgxpool.Pool, cfg *Config) (*Engine, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: pool is nil", ErrInvalidConfig)
	}
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	st, err := store.New(c.Schema)
	if err != nil {
		return nil, fmt.Errorf("%w: Schema: %w", ErrInvalidConfig, err)
	}
	st.SetDeadlineRoom(c.RescueSlack)
	ob, err := outbox.New(pool, c.Schema)
	if err != nil {
		return nil, fmt.Errorf("%w: Schema: %w", ErrInvalidConfig, err)
	}
	var signer signing.Keys
	if c.Kafka != nil {
		signer = signing.Keys{Current: c.Kafka.SigningKey, Previous: c.Kafka.VerifyKeys}
	}
	e := &Engine{
		pool: pool, cfg: c, st: st, outbox: ob, log: telemetry.Logger(c.Logger), signer: signer,
		machine:  machine{slack: c.RescueSlack, maxState: c.MaxStateBytes},
		notifier: notifier{from: "@" + uuid.NewString()[:8], sleep: time.Sleep},
		starts:   newStartGroup(),
	}
	if e.tel, err = newEngineTelemetry(e); err != nil {
		return nil, fmt.Errorf("saga: telemetry: %w", err)
	}
	e.defs.Store(&registry{byName: map[string]*compiled{}, byVersion: map[nameVersion]*compiled{}, byOwner: map[any]*compiled{}})
	return e, nil
}

// registry is a snapshot of the definitions registered with an engine.
// Nothing changes it once it is stored: Register makes a new one.
type registry struct {
	// byName holds each name's newest registered version; byVersion every
	// version.
	byName    map[string]*compiled
	byVersion map[nameVersion]*compiled
	byOwner   map[any]*compiled
	known     []string // aggregatetype of the commands of registered sagas
	names     []string // registered saga names, in the order of registration
	// maxTimeout is the longest timeout of any registered step.
	maxTimeout time.Duration
	// parallel is true when a registered saga has a parallel step.
	parallel bool
}

// with returns a registry with defs added to r's.
func (r *registry) with(defs []*compiled) *registry {
	out := &registry{
		byName: make(map[string]*compiled, len(r.byName)+len(defs)), byOwner: make(map[any]*compiled, len(r.byOwner)+len(defs)),
		byVersion: make(map[nameVersion]*compiled, len(r.byVersion)+len(defs)),
		known:     slices.Clone(r.known), names: slices.Clone(r.names), maxTimeout: r.maxTimeout, parallel: r.parallel,
	}
	maps.Copy(out.byName, r.byName)
	maps.Copy(out.byOwner, r.byOwner)
	maps.Copy(out.byVersion, r.byVersion)
	for _, c := range defs {
		if old := out.byName[c.name]; old == nil {
			out.names = append(out.names, c.name)
			out.byName[c.name] = c
		} else if c.version > old.version {
			out.byName[c.name] = c
		}
		out.byVersion[nameVersion{c.name, c.version}] = c
		out.byOwner[c.owner] = c
		out.known = append(out.known, aggregateType(c.name, c.version))
		for _, s := range c.steps {
			out.maxTimeout = max(out.maxTimeout, s.timeout)
			if s.parallel != nil {
				out.parallel = true
				for _, br := range s.parallel.branches {
					out.maxTimeout = max(out.maxTimeout, br.timeout)
				}
			}
		}
	}
	return out
}

// registered returns the snapshot of the registered definitions.
func (e *Engine) registered() *registry { return e.defs.Load() }

// Register adds saga definitions. It rejects an invalid definition and a
// name already registered at the same version (several versions of one
// name may be registered: see [Definition.WithVersion]), and fails once
// the engine has been started.
func (e *Engine) Register(defs ...AnyDefinition) error {
	if err := e.ready("Engine.Register"); err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.frozen {
		return ErrEngineStarted
	}
	reg := e.registered()
	compiledDefs := make([]*compiled, 0, len(defs))
	seen := map[nameVersion]bool{}
	for _, d := range defs {
		if d == nil {
			return fmt.Errorf("%w: nil definition", ErrInvalidDefinition)
		}
		c, err := d.compile()
		if err != nil {
			return err
		}
		if c.hasParallel() && e.allKafka() {
			return fmt.Errorf("%w: saga %q has a Parallel step, which needs the Postgres-only or hybrid mode (not KafkaConfig.AllSteps)", ErrInvalidDefinition, c.name)
		}
		if c.hasRemote() && e.cfg.Kafka == nil {
			return fmt.Errorf("%w: saga %q has Remote steps, which need an engine with Kafka (Config.Kafka) to reach the participants", ErrInvalidDefinition, c.name)
		}
		nv := nameVersion{c.name, c.version}
		if _, dup := reg.byVersion[nv]; dup || seen[nv] {
			return fmt.Errorf("%w: a saga named %q is already registered at version %d", ErrInvalidDefinition, c.name, c.version)
		}
		seen[nv] = true
		compiledDefs = append(compiledDefs, c)
	}
	e.defs.Store(reg.with(compiledDefs))
	return nil
}

// ready returns an error wrapping [ErrNilEngine] when e is nil or was not
// made by [New]; every entry point checks it before it uses e.
func (e *Engine) ready(op string) error {
	if e == nil || e.st == nil {
		return fmt.Errorf("%w: %s needs an engine made by saga.New", ErrNilEngine, op)
	}
	return nil
}

// aggregateType is the outbox aggregatetype of a saga's commands.
// At version 1 it is "saga.<name>", as before versions existed; at a later
// version v "saga.<name>@v<v>" (see 011_versions.up.sql).
func aggregateType(name string, version int) string {
	if version <= 1 {
		return "saga." + name
	}
	return "saga." + name + "@v" + strconv.Itoa(version)
}

func (e *Engine) registeredNameList() []string { return e.registered().names }

func (e *Engine) knownAggregates() []string { return e.registered().known }

func (e *Engine) lookupOwner(owner any, name string) (*compiled, error) {
	reg := e.registered()
	c := reg.byOwner[owner]
	if c == nil {
		if reg.byName[name] != nil {
			return nil, fmt.Errorf("%w: %q: a different Definition value with that name is registered; start sagas with the value you registered", ErrNotRegistered, name)
		}
		return nil, fmt.Errorf("%w: %q", ErrNotRegistered, name)
	}
	return c, nil
}

// lookup returns the definition sg runs on: its name at its version, or nil
// when this engine did not register that version.
func (e *Engine) lookup(sg *store.Saga) *compiled {
	return e.registered().byVersion[nameVersion{sg.Name, max(sg.DefVersion, 1)}]
}

func (e *Engine) registeredNames() string {
	names := slices.Sorted(slices.Values(e.registered().names))
	return strings.Join(names, ", ")
}

// maxStepTimeout is the longest timeout of any registered step.
func (e *Engine) maxStepTimeout() time.Duration { return e.registered().maxTimeout }

// Start launches the engine's workers, its notification listener and its
// scheduler, and returns at once. Calling it on a running engine does
// nothing; calling it while Stop is in progress returns an error. Cancelling
// ctx stops the engine hard, as [Engine.StopAndCancel] does.
//
// Start first checks that the schema has every migration this version needs
// (see migrations.Check), and returns an error wrapping
// migrations.ErrNotMigrated when it has not. When the database cannot be
// asked, it logs a warning and starts: its workers wait for the database as
// they do whenever it is away.
func (e *Engine) Start(ctx context.Context) error {
	if err := e.ready("Engine.Start"); err != nil {
		return err
	}
	if err := e.checkSchema(ctx); err != nil {
		return err
	}
	e.mu.Lock()
	// The registry snapshot is final from here on: Register refuses, and
	// the workers read the snapshot without a lock.
	e.frozen = true
	schedules := e.schedules
	e.mu.Unlock()
	started, err := e.life.Start(ctx, func(fetch, work context.Context, wg *sync.WaitGroup) {
		schedulerDone := e.startScheduler(fetch, schedules)
		wg.Go(func() { <-schedulerDone })
		for range e.kafkaReaders() {
			r := e.newCommandReader()
			wg.Go(func() { e.kafkaWork(fetch, work, r) })
		}
		// One wake-up reaches one worker: a send hands it to an idle
		// worker, or, when none is idle, leaves it for the next worker to
		// go idle. Waking every worker for each commit made all of them
		// claim (and look up the next due command) for one command: on a
		// small machine that herd was most of a signal's latency.
		wakeup := make(chan struct{}, 1)
		wake := func() {
			select {
			case wakeup <- struct{}{}:
			default:
			}
		}
		if !e.allKafka() {
			// In Kafka mode the commands a batch writes are relay rows: the
			// direct worker has nothing to wake for.
			e.wakeLocal.Store(&wake)
		}
		direct := e.directWorkers()
		wg.Go(func() { e.listen(fetch, wake, direct) })
		wg.Go(func() { e.watchCancels(fetch) })
		for range direct {
			wg.Go(func() { e.work(fetch, work, wakeup) })
		}
	})
	if err != nil {
		return fmt.Errorf("saga: engine: %w", err)
	}
	if started {
		e.log.InfoContext(ctx, "sagaflow engine started", slog.String("schema", e.cfg.Schema),
			slog.Int("workers", e.cfg.Workers), slog.Int("batch_size", e.cfg.BatchSize))
	}
	return nil
}

// schemaCheckTimeout bounds Start's check of the schema's migrations.
const schemaCheckTimeout = 5 * time.Second

// checkSchema refuses a schema that lacks migrations. A check that cannot
// reach the database is only logged: the workers wait for it anyway.
func (e *Engine) checkSchema(ctx context.Context) error {
	checkCtx, cancel := context.WithTimeout(ctx, schemaCheckTimeout)
	defer cancel()
	err := migrations.Check(checkCtx, e.pool, e.cfg.Schema)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, migrations.ErrNotMigrated):
		return fmt.Errorf("saga: engine: %w", err)
	}
	e.log.WarnContext(ctx, "sagaflow could not check the schema's migrations; starting anyway",
		slog.String("schema", e.cfg.Schema), slog.Any("error", err))
	return nil
}

// Stop stops claiming new commands, lets the steps in flight finish, and
// returns when every worker has exited. If ctx ends first, Stop cancels the
// handlers still running (a hard stop), waits for them to return and then
// returns ctx.Err(). Stop on an engine that is not running returns nil; it
// is safe to call concurrently and repeatedly.
func (e *Engine) Stop(ctx context.Context) error {
	return e.stop(ctx, false)
}

// StopAndCancel stops the engine at once: it cancels running handlers, whose
// transactions roll back, so their steps run again later (the other
// engines on the schema are told to look for them at once). It waits for
// the workers to exit or for ctx to end.
func (e *Engine) StopAndCancel(ctx context.Context) error {
	return e.stop(ctx, true)
}

func (e *Engine) stop(ctx context.Context, hard bool) error {
	if err := e.ready("Engine.Stop"); err != nil {
		return err
	}
	stopped, err := e.life.Stop(ctx, hard)
	if stopped && (e.wakesDue.Load() > 0 || hard || err != nil) {
		// Commands this engine wrote for later (a retry, a deferral) would
		// have been run by its workers when due, and the commands of the
		// batches a hard stop (or a stop whose ctx ended) rolled back are
		// due and free again, while the other engines' last looks took
		// them for ones a worker held: the other engines are told to look
		// again, or they would find them at their next poll only.
		nctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), notifyTimeout)
		if nerr := e.st.Notify(nctx, e.pool, e.cfg.CommandTopic+e.notifier.from); nerr != nil {
			e.log.WarnContext(ctx, "sagaflow could not tell the other engines of commands left to them; they will find them at their next poll",
				slog.Any("error", nerr))
		}
		cancel()
	}
	if stopped && err == nil {
		e.log.InfoContext(ctx, "sagaflow engine stopped", slog.String("schema", e.cfg.Schema))
	}
	return err
}

// listen wakes the workers when PostgreSQL announces new commands. If the
// listening connection fails, workers keep polling until it is back.
func (e *Engine) listen(ctx context.Context, wake func(), workers int) {
	lifecycle.Listen(ctx, e.pool, e.st.Channel(), e.log, "engine", func(payload string) {
		switch {
		case payload == "":
			// (Re)connected: requests made while no one listened, and
			// commands announced meanwhile: every worker looks.
			go e.interrupt(ctx, e.running.ids())
			for range workers {
				wake()
			}
		case e.notifier.own(payload):
			// This engine's own announcement: its workers were woken when
			// it was made (see announce).
		default:
			e.notified(ctx, payload)
			wake()
		}
	}, &e.hstate.listening)
}

// work is one executor goroutine: claim a batch, run it, wait for more.
func (e *Engine) work(fetchCtx, workCtx context.Context, wake chan struct{}) {
	e.hstate.workerUp()
	defer e.hstate.workerDown()
	failures := 0
	// isolate is how many claims after a failed batch take one command
	// each: the command that fails its batch (a statement of the batch's
	// end refused for it, say) then fails alone and is moved back, and the
	// commands claimed beside it run.
	isolate := 0
	for fetchCtx.Err() == nil {
		claimed := time.Now()
		limit := e.cfg.BatchSize
		if isolate > 0 {
			limit = 1
			isolate--
		}
		res, err := e.runBatchOn(fetchCtx, workCtx, e.cfg.CommandTopic, limit)
		if err == nil && e.registered().parallel {
			// One branch of a parallel step per round, so that the
			// branches of one saga run on several workers at once.
			var br batchResult
			br, err = e.runBatchOn(fetchCtx, workCtx, e.branchTopic(), 1)
			res.claimed += br.claimed
			res.readyCreated = res.readyCreated || br.readyCreated || br.claimed > 0
		}
		if err != nil {
			if fetchCtx.Err() != nil {
				return
			}
			e.hstate.claimed(err)
			failures++
			e.log.ErrorContext(workCtx, "sagaflow worker batch failed; its commands will run again",
				slog.Any("error", err), slog.Int("consecutive_failures", failures))
			if limit == 1 && res.one != uuid.Nil && e.moveBack(workCtx, res.one, err) {
				continue // the commands behind it run now
			}
			if res.claimed > 1 {
				isolate = res.claimed
			}
			if !lifecycle.Sleep(fetchCtx, lifecycle.Backoff(failures)) {
				return
			}
			continue
		}
		failures = 0
		e.hstate.claimed(nil)
		if res.claimed >= limit || res.readyCreated {
			continue
		}
		if h := e.hooks.idle; h != nil {
			h()
		}
		// The look ahead counts commands that came due since the claim
		// began (which it could not take), not only those due later: one
		// that came due between the claim and this look would otherwise
		// wait for the next poll.
		wait := e.cfg.PollInterval
		since := time.Since(claimed)
		if d, ok, err := e.st.NextDirectDue(fetchCtx, e.pool, e.cfg.CommandTopic, e.knownAggregates(), e.cfg.UnknownSagaGrace, since); err == nil && ok {
			wait = min(wait, max(d, time.Millisecond))
		}
		if e.registered().parallel {
			if d, ok, err := e.st.NextDirectDue(fetchCtx, e.pool, e.branchTopic(), e.knownAggregates(), e.cfg.UnknownSagaGrace, since); err == nil && ok {
				wait = min(wait, max(d, time.Millisecond))
			}
		}
		timer := time.NewTimer(wait)
		select {
		case <-fetchCtx.Done():
			timer.Stop()
			return
		case <-wake:
		case <-timer.C:
		}
		timer.Stop()
	}
}

// moveBack defers a command that failed a batch of its own, as a command
// whose saga is busy is deferred (its delay doubling per attempt, at most
// deferDelayMax), with the batch's error as its last error, so that the
// commands behind it are claimed first; it reports whether it did. The
// command is not parked: it runs again when it is due, and succeeds once
// the cause is gone.
func (e *Engine) moveBack(ctx context.Context, id uuid.UUID, cause error) bool {
	q := &pgx.Batch{}
	e.st.QueueDefer(q, []uuid.UUID{id}, deferDelay, deferDelayMax, safetext.Text("its batch failed: "+cause.Error(), 2000),
		func(due time.Duration) { e.wakeIn(due) })
	if err := e.pool.SendBatch(context.WithoutCancel(ctx), q).Close(); err != nil {
		e.log.WarnContext(ctx, "sagaflow could not move back a command that failed its batch", slog.String("command_id", id.String()),
			slog.Any("error", err))
		return false
	}
	e.stats.movedBack.Add(1)
	return true
}

// Stats are counters of what the engine did since it was created: its
// workers, its rescuer and scheduler, and its starts (StartsGrouped counts on
// an engine that was never started too).
// What a batch did is counted as it commits (just before, so that whoever
// sees the commit sees its counts, and taken back if the commit fails): a
// batch rolled back (a crash, a batch from the bus run again one message at a
// time) counts nothing.
type Stats struct {
	StepsSucceeded    int64 // step attempts (actions and compensations) that committed
	AttemptsFailed    int64 // attempts that failed, retried or not, abandoned ones included
	Retries           int64 // retries scheduled
	Deduplicated      int64 // steps skipped because their key was in the inbox
	StaleDiscarded    int64 // commands or commits refused because the saga had moved on
	Deferred          int64 // commands put back because another worker held their saga
	Parked            int64 // commands parked as dead, with their reason
	HandlersAbandoned int64 // attempts abandoned because their handler ignored its timeout (also in AttemptsFailed)
	CancelsApplied    int64 // cancel requests applied by this engine's workers
	Rescued           int64 // stuck sagas re-driven by the rescuer
	FailedOver        int64 // stuck sagas whose attempts were spent, moved to compensation or failed
	CronStarted       int64 // sagas started by a schedule
	CronDuplicates    int64 // schedule slots another engine had already started
	Chained           int64 // steps run in the transaction of the step, reply or wait's end before them
	BusBatched        int64 // messages from the bus run several to a transaction
	BusBatchesRerun   int64 // bus batches given up and run one message at a time (a busy saga, an overran handler, a failed transaction)
	Released          int64 // held commands released by the rescuer because no pause covered them any more
	StartsGrouped     int64 // starts (Start, on the engine's pool) committed in one transaction with others
	// steps run at once on a Kafka reply worker that ran past
	// KafkaConfig.ReplyStepLimit and were handed to an engine worker
	StepsHandedOff int64
	// commands that failed a batch of their own (claimed one at a time
	// after their batch failed) and were moved back, so that the commands
	// behind them ran first
	MovedBack int64
}

type statCounters struct {
	succeeded, failed, retries, dedup, stale, deferred, parked, abandoned              atomic.Int64
	rescued, failedOver, cronStarted, cronDuplicates, cancelled, chained, kafkaBatched atomic.Int64
	released, cut                                                                      atomic.Int64
	// Not taken back with a batch: counted when a batch is given up.
	busRerun, movedBack atomic.Int64
}

// add adds o's counters to c's, times sign (1, or -1 to take them back).
func (c *statCounters) add(o *statCounters, sign int64) {
	for _, p := range [][2]*atomic.Int64{
		{&c.succeeded, &o.succeeded}, {&c.failed, &o.failed}, {&c.retries, &o.retries}, {&c.dedup, &o.dedup},
		{&c.stale, &o.stale}, {&c.deferred, &o.deferred}, {&c.parked, &o.parked}, {&c.abandoned, &o.abandoned},
		{&c.rescued, &o.rescued}, {&c.failedOver, &o.failedOver}, {&c.cronStarted, &o.cronStarted},
		{&c.cronDuplicates, &o.cronDuplicates}, {&c.cancelled, &o.cancelled}, {&c.chained, &o.chained},
		{&c.kafkaBatched, &o.kafkaBatched}, {&c.released, &o.released}, {&c.cut, &o.cut},
	} {
		if n := p[1].Load(); n != 0 {
			p[0].Add(sign * n)
		}
	}
}

// Schema returns the schema that holds the engine's tables (Config.Schema,
// or its default); "" for a nil engine.
func (e *Engine) Schema() string {
	if e == nil {
		return ""
	}
	return e.cfg.Schema
}

// Stats returns the engine's counters; zero for a nil engine.
func (e *Engine) Stats() Stats {
	if e == nil {
		return Stats{}
	}
	s := &e.stats
	return Stats{
		// An abandoned handler's attempt failed too; it is recorded apart
		// from the batch it was in.
		StepsSucceeded: s.succeeded.Load(), AttemptsFailed: s.failed.Load() + s.abandoned.Load(), Retries: s.retries.Load(),
		Deduplicated: s.dedup.Load(), StaleDiscarded: s.stale.Load(), Deferred: s.deferred.Load(),
		Parked: s.parked.Load(), HandlersAbandoned: s.abandoned.Load(), CancelsApplied: s.cancelled.Load(),
		Rescued: s.rescued.Load(), FailedOver: s.failedOver.Load(),
		CronStarted: s.cronStarted.Load(), CronDuplicates: s.cronDuplicates.Load(), Chained: s.chained.Load(),
		BusBatched: s.kafkaBatched.Load(), Released: s.released.Load(), StartsGrouped: e.starts.count(),
		StepsHandedOff: s.cut.Load(), BusBatchesRerun: s.busRerun.Load(), MovedBack: s.movedBack.Load(),
	}
}
