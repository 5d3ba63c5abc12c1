package saga

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/robfig/cron/v3"
)

// The scheduler runs inside every started engine: the stuck-saga rescuer,
// retention, and the sagas started by [Schedule]. Its jobs are safe to run on
// many engines at once, so no leader is elected: the rescuer takes each saga
// with a lock it does not wait for and guards every update on the version it
// read; retention deletes rows it locks with SKIP LOCKED; a cron slot starts
// its saga under a business key that names the slot, so only one start per
// slot succeeds whichever engines fire it.

// cronParser accepts standard five-field specs, an optional leading seconds
// field, and descriptors such as @hourly and @every 5m.
var cronParser = cron.NewParser(cron.SecondOptional | cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)

// ScheduleOpts are the options of [Schedule]. nil means none.
type ScheduleOpts struct {
	// Name identifies the schedule in business keys and logs. Defaults to
	// the saga's name and the spec.
	Name string
}

type schedule struct {
	name     string
	spec     string
	sched    cron.Schedule
	start    func(ctx context.Context, businessKey string) (Started, error)
	sagaName string
}

// Schedule starts a saga of definition d with state at every slot of the cron
// spec (in Config.Location), exactly once per slot however many engines run
// the schedule: the slot's time is part of the saga's business key
// ("cron:<name>:<slot in RFC 3339>"). Specs have five fields, or six with
// seconds first, or are descriptors (@hourly, @every 10m; @every slots are
// aligned to multiples of the interval, which must be whole seconds, at
// least one). Call it before [Engine.Start].
func Schedule[S any](e *Engine, spec string, d *Definition[S], state S, opts *ScheduleOpts) error {
	if err := e.ready("Schedule"); err != nil {
		return err
	}
	sched, err := parseSpec(spec)
	if err != nil {
		return fmt.Errorf("saga: schedule %q: %w", spec, err)
	}
	if d == nil {
		return fmt.Errorf("%w: nil definition", ErrNotRegistered)
	}
	if _, err := e.lookupOwner(d, d.name); err != nil {
		return err
	}
	name := d.name + " " + spec
	if opts != nil && opts.Name != "" {
		name = opts.Name
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.frozen {
		return ErrEngineStarted
	}
	for _, other := range e.schedules {
		if other.name == name {
			return fmt.Errorf("saga: schedule %q: a schedule with that name exists; name it with ScheduleOpts.Name", name)
		}
	}
	e.schedules = append(e.schedules, schedule{
		name: name, spec: spec, sched: sched, sagaName: d.name,
		start: func(ctx context.Context, key string) (Started, error) {
			return Start(ctx, e, d, state, &StartOpts{BusinessKey: key})
		},
	})
	return nil
}

// parseSpec parses a cron spec, refusing what cron would silently change: an
// @every interval under a second (cron runs it every second) or with a
// fraction of a second (cron drops the fraction). It also turns the panic
// of cron's parser on a time zone with no spec after it into an error.
func parseSpec(spec string) (cron.Schedule, error) {
	rest := spec
	if strings.HasPrefix(rest, "TZ=") || strings.HasPrefix(rest, "CRON_TZ=") {
		_, after, ok := strings.Cut(rest, " ")
		if !ok || strings.TrimSpace(after) == "" {
			return nil, errors.New("a time zone must be followed by a spec")
		}
		rest = strings.TrimSpace(after)
	}
	if interval, ok := strings.CutPrefix(rest, "@every "); ok {
		d, err := time.ParseDuration(interval)
		switch {
		case err != nil:
			return nil, err
		case d < time.Second:
			return nil, fmt.Errorf("the interval must be at least 1s, not %s", interval)
		case d%time.Second != 0:
			return nil, fmt.Errorf("the interval must be whole seconds, not %s", interval)
		}
	}
	return cronParser.Parse(spec)
}

// slotTime returns the slot a firing belongs to: the time the schedule
// planned, aligned for @every schedules so that engines started at different
// moments agree.
func slotTime(sched cron.Schedule, planned time.Time) time.Time {
	if every, ok := sched.(cron.ConstantDelaySchedule); ok && every.Delay > 0 {
		return planned.Truncate(every.Delay)
	}
	return planned
}

// startScheduler starts the engine's cron with the maintenance jobs and
// schedules; it stops when ctx ends, and the returned channel is closed
// once its running jobs have returned. The caller holds e.mu.
func (e *Engine) startScheduler(ctx context.Context, schedules []schedule) <-chan struct{} {
	c := cron.New(cron.WithLocation(e.cfg.Location), cron.WithParser(cronParser))
	logger := cronLogger{e.log}
	// A maintenance job skips its turn while its previous run goes on; a
	// schedule never does: every slot is started (its business key keeps a
	// slot from starting twice).
	maintenance := cron.NewChain(cron.Recover(logger), cron.SkipIfStillRunning(logger))
	slots := cron.NewChain(cron.Recover(logger))
	every := func(d time.Duration) cron.Schedule { return cron.Every(d) }
	c.Schedule(every(e.cfg.RescueInterval), maintenance.Then(cron.FuncJob(func() {
		if _, err := e.RescueNow(ctx); err != nil && ctx.Err() == nil {
			e.log.ErrorContext(ctx, "sagaflow rescuer failed; it runs again at its next interval", slog.Any("error", err))
		}
	})))
	c.Schedule(every(e.cfg.RetentionInterval), maintenance.Then(cron.FuncJob(func() {
		if _, err := e.RunRetention(ctx); err != nil && ctx.Err() == nil {
			e.log.ErrorContext(ctx, "sagaflow retention failed; it runs again at its next interval", slog.Any("error", err))
		}
	})))
	for _, s := range schedules {
		var id cron.EntryID
		id = c.Schedule(s.sched, slots.Then(cron.FuncJob(func() {
			slot := slotTime(s.sched, c.Entry(id).Prev).In(e.cfg.Location)
			key := "cron:" + s.name + ":" + slot.Format(time.RFC3339)
			st, err := s.start(ctx, key)
			switch {
			case err != nil && ctx.Err() == nil:
				e.log.ErrorContext(ctx, "sagaflow could not start a scheduled saga", slog.String("schedule", s.name),
					slog.String("business_key", key), slog.Any("error", err))
			case err != nil:
			case st.Existing:
				e.stats.cronDuplicates.Add(1)
			default:
				e.stats.cronStarted.Add(1)
				e.log.InfoContext(ctx, "sagaflow started a scheduled saga", slog.String("schedule", s.name),
					slog.String("saga_id", st.ID.String()), slog.String("business_key", key))
			}
		})))
	}
	c.Start()
	done := make(chan struct{})
	go func() {
		<-ctx.Done()
		<-c.Stop().Done()
		close(done)
	}()
	return done
}

// cronLogger sends cron's own messages to the engine's logger.
type cronLogger struct{ log *slog.Logger }

func (l cronLogger) Info(msg string, kv ...any) { l.log.Debug("sagaflow scheduler: "+msg, kv...) }
func (l cronLogger) Error(err error, msg string, kv ...any) {
	if errors.Is(err, context.Canceled) {
		return
	}
	l.log.Error("sagaflow scheduler: "+msg, append(kv, "error", err)...)
}
