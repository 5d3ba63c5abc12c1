package relay

import (
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/internal/lifecycle"
	"github.com/sagaflow/sagaflow/internal/store"
)

// Configuration defaults.
const (
	// BatchSizeDefault is how many rows one cycle claims and publishes.
	BatchSizeDefault = 100
	// BatchSizeMax bounds BatchSize: the rows of a batch stay locked while
	// the batch is published.
	BatchSizeMax = 10000
	// PollIntervalDefault is the longest an idle relay waits before it
	// looks for due rows.
	PollIntervalDefault = time.Second
	// MaxAttemptsDefault is how many failed publish attempts a row gets
	// before it is parked as dead.
	MaxAttemptsDefault = 10
	// MaxMessageBytesDefault bounds a message (key, value and headers):
	// Kafka's default message.max.bytes is about 1 MiB.
	MaxMessageBytesDefault = 1 << 20
	// PublishTimeoutDefault bounds one cycle's write to the broker, during
	// which the batch's rows stay locked.
	PublishTimeoutDefault = 30 * time.Second
	// PublishTimeoutMin is the shortest PublishTimeout (of Config and
	// LogicalConfig): a write given less ends before it can reach the
	// broker, and the relay would take the broker for down for ever.
	PublishTimeoutMin = 10 * time.Millisecond
	// OutageBackoffMaxDefault caps how long rows wait between attempts
	// while the broker is down, and so how late publishing resumes after it
	// is back.
	OutageBackoffMaxDefault = 30 * time.Second
	// BackoffMinDefault and BackoffMaxDefault bound [DefaultBackoff].
	BackoffMinDefault = time.Second
	BackoffMaxDefault = 5 * time.Minute
)

// BackoffFunc returns how long a row waits before its next publish attempt,
// given how many attempts have failed so far (1 after the first failure).
type BackoffFunc func(attempt int) time.Duration

// DefaultBackoff doubles from one second after the first failure to five
// minutes, with ±20% jitter so that rows that failed together do not come
// back together.
func DefaultBackoff(attempt int) time.Duration {
	d := lifecycle.Exponential(BackoffMinDefault, BackoffMaxDefault, attempt)
	return min(lifecycle.Jitter(d, -0.2, 0.2), BackoffMaxDefault)
}

// Config configures a [Relay]. A nil *Config, and every zero field, means
// the default.
type Config struct {
	// Schema holds sagaflow's tables. Defaults to migrations.SchemaDefault
	// ("sagaflow").
	Schema string
	// BatchSize is how many rows one cycle claims (FOR UPDATE SKIP
	// LOCKED), writes to the broker in one call and marks in one
	// transaction. Defaults to BatchSizeDefault; at most BatchSizeMax.
	BatchSize int
	// PollInterval is the longest an idle relay waits before it looks for
	// due rows again. A notification on the schema's channel (the engine
	// and outbox.InsertTx notify it when they write messages), a call to
	// [Relay.Wake], or the next retry coming due wakes it sooner. Defaults
	// to PollIntervalDefault.
	PollInterval time.Duration
	// MaxAttempts is how many failed publish attempts a row gets; the row
	// that fails the last one is parked as dead with its last error.
	// Attempts that failed because the broker was down (it could not be
	// reached, timed out, or had no leader or too few in-sync replicas) do
	// not count: an outage makes rows wait, however long it lasts.
	// Defaults to MaxAttemptsDefault.
	MaxAttempts int
	// Backoff is how long a row that failed waits before its next attempt.
	// While the broker is down it is given the number of consecutive cycles
	// that found it down, and capped by OutageBackoffMax. Defaults to
	// DefaultBackoff (1s doubling to 5m, with jitter).
	Backoff BackoffFunc
	// OutageBackoffMax caps the wait of rows, and of the relay before it
	// claims again, while the broker is down. Defaults to
	// OutageBackoffMaxDefault (30s).
	OutageBackoffMax time.Duration
	// MaxMessageBytes bounds a message's key, value and headers together.
	// A larger row is parked as dead at once, with its size in the reason,
	// rather than failing the batch it is in. Keep it no larger than the
	// broker's message.max.bytes and the writer's batch bytes. Defaults to
	// MaxMessageBytesDefault (1 MiB).
	MaxMessageBytes int
	// PublishTimeout bounds one cycle's write to the broker; the batch's
	// rows are locked meanwhile. A write that times out is a broker outage:
	// the batch's rows wait, without spending an attempt, unless the writer
	// judges its own timeouts otherwise (a [PublishError]: package webhook
	// counts a request that timed out as an attempt, since the endpoint may
	// have acted on it). Defaults to PublishTimeoutDefault.
	PublishTimeout time.Duration
	// Retention is how long published rows are kept (the window in which
	// they can be replayed): a running relay deletes older ones every
	// RetentionInterval, so a service without a saga engine cleans its own
	// outbox. Defaults to RetentionDefault; negative keeps them (an engine
	// on the same schema deletes them after its OutboxRetention). Pending
	// and dead rows are never deleted.
	Retention time.Duration
	// RetentionInterval is how often old published rows are deleted.
	// Defaults to RetentionIntervalDefault.
	RetentionInterval time.Duration
	// Logger receives the relay's logs (never payloads). Defaults to
	// slog.Default().
	Logger *slog.Logger
	// TracerProvider makes the relay's spans: one per publish, linked to
	// the messages' trace contexts, and one per traced message in its own
	// trace. Defaults to OpenTelemetry's global provider.
	TracerProvider trace.TracerProvider
	// MeterProvider makes the relay's metrics (see docs/observability.md).
	// Defaults to OpenTelemetry's global provider.
	MeterProvider metric.MeterProvider
	// GaugeInterval is the least time between two of the queries behind
	// the outbox gauges (pending rows, oldest pending age, dead rows).
	// Defaults to GaugeIntervalDefault.
	GaugeInterval time.Duration
	// Sweeper makes this relay the sweeper beside a log-based relay
	// ([LogicalRelay]): it claims only the rows the stream does not carry
	// (rows due later than they were written, rows that failed or were
	// requeued or replayed, which have attempts) and rows pending longer
	// than SweepAfter (a backstop for a slot that lost rows), and it does
	// not LISTEN, so it never races the log-based relay for a row due at
	// once while the stream keeps up (a row the stream holds back longer
	// than SweepAfter may be published by both). Defaults to false: a relay
	// that publishes every due row.
	Sweeper bool
	// SweepAfter is, for a Sweeper, how long a row that the log-based relay
	// should publish may stay pending before the sweeper publishes it.
	// Defaults to SweepAfterDefault.
	SweepAfter time.Duration
}

// SweepAfterDefault is a sweeper's default SweepAfter.
const SweepAfterDefault = 30 * time.Second

// Retention defaults of a [Relay].
const (
	// RetentionDefault keeps published rows 7 days, like the engine's
	// default OutboxRetention.
	RetentionDefault = 7 * 24 * time.Hour
	// RetentionIntervalDefault is how often a relay deletes old rows.
	RetentionIntervalDefault = time.Hour
	// retentionBatch bounds the rows of one delete statement.
	retentionBatch = 1000
)

func (c *Config) withDefaults() (Config, error) {
	out := Config{}
	if c != nil {
		out = *c
	}
	if out.SweepAfter < 0 {
		return out, fmt.Errorf("%w: SweepAfter must not be negative", ErrInvalidConfig)
	}
	if out.Sweeper && out.SweepAfter == 0 {
		out.SweepAfter = SweepAfterDefault
	}
	if out.Schema == "" {
		out.Schema = store.SchemaDefault
	}
	if err := store.ValidateSchema(out.Schema); err != nil {
		return out, fmt.Errorf("%w: Schema: %w", ErrInvalidConfig, err)
	}
	for _, ch := range []struct {
		bad  bool
		what string
	}{
		{out.BatchSize < 0 || out.BatchSize > BatchSizeMax, fmt.Sprintf("BatchSize must be between 1 and %d", BatchSizeMax)},
		{out.PollInterval < 0, "PollInterval must not be negative"},
		{out.MaxAttempts < 0, "MaxAttempts must not be negative"},
		{out.MaxMessageBytes < 0, "MaxMessageBytes must not be negative"},
		{out.PublishTimeout < 0, "PublishTimeout must not be negative"},
		{out.PublishTimeout > 0 && out.PublishTimeout < PublishTimeoutMin, fmt.Sprintf("PublishTimeout %v is shorter than PublishTimeoutMin (%v)", out.PublishTimeout, PublishTimeoutMin)},
		{out.OutageBackoffMax < 0, "OutageBackoffMax must not be negative"},
		{out.RetentionInterval < 0, "RetentionInterval must not be negative"},
	} {
		if ch.bad {
			return out, fmt.Errorf("%w: %s", ErrInvalidConfig, ch.what)
		}
	}
	if out.BatchSize == 0 {
		out.BatchSize = BatchSizeDefault
	}
	if out.Retention == 0 {
		out.Retention = RetentionDefault
	}
	if out.RetentionInterval == 0 {
		out.RetentionInterval = RetentionIntervalDefault
	}
	if out.PollInterval == 0 {
		out.PollInterval = PollIntervalDefault
	}
	if out.MaxAttempts == 0 {
		out.MaxAttempts = MaxAttemptsDefault
	}
	if out.Backoff == nil {
		out.Backoff = DefaultBackoff
	}
	if out.OutageBackoffMax == 0 {
		out.OutageBackoffMax = OutageBackoffMaxDefault
	}
	if out.MaxMessageBytes == 0 {
		out.MaxMessageBytes = MaxMessageBytesDefault
	}
	if out.PublishTimeout == 0 {
		out.PublishTimeout = PublishTimeoutDefault
	}
	if out.Logger == nil {
		out.Logger = slog.Default()
	}
	if out.GaugeInterval < 0 {
		return out, fmt.Errorf("%w: GaugeInterval must not be negative", ErrInvalidConfig)
	}
	if out.GaugeInterval == 0 {
		out.GaugeInterval = GaugeIntervalDefault
	}
	return out, nil
}
