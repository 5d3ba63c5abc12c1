package review6_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/steps"
)

// st2 is version 2's state: the field was renamed.
type st2 struct {
	Count int    `json:"count"`
	Label string `json:"label"`
}

// orderV1 and orderV2 are two versions of the saga "order"; each step
// records "v<version>-<step>".
func orderV1(v *env, extra ...saga.Step[st]) *saga.Definition[st] {
	rec := func(name string) saga.StepFunc[st] {
		return func(ctx context.Context, run *saga.StepRun, s *st) error {
			s.N++
			return v.fx.Record(ctx, run, "v1-"+name)
		}
	}
	ss := []saga.Step[st]{{Name: "a", Action: rec("a")}, {Name: "b", Action: rec("b")}}
	return saga.Define("order", append(ss, extra...)...)
}

func orderV2(v *env) *saga.Definition[st2] {
	rec := func(name string) saga.StepFunc[st2] {
		return func(ctx context.Context, run *saga.StepRun, s *st2) error {
			s.Count++
			return v.fx.Record(ctx, run, "v2-"+name)
		}
	}
	return saga.Define("order",
		saga.Step[st2]{Name: "a", Action: rec("a")},
		saga.Step[st2]{Name: "b", Action: rec("b")},
		saga.Step[st2]{Name: "d", Action: rec("d")},
	).WithVersion(2)
}

func fwd(step string) saga.Position { return saga.Position{Step: step, Direction: steps.Forward} }

// doc.go "Versions": "[Engine.Register] takes several versions of a name,
// new sagas start on the version passed to [Start], and each saga's steps
// run on its own version." and "a saga runs to its end on the version it
// started with ([Instance.DefinitionVersion])". "[Engine.Versions] ...
// counts the sagas on each version".
func TestVersionsSideBySide(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	v1, v2 := orderV1(v), orderV2(v)
	require.Equal(t, 1, v1.Version(), "1 when never set")
	require.Equal(t, 2, v2.Version())

	// Counted before they run: a client engine starts them.
	client := v.engine(t, false, v1, v2)
	a, err := saga.Start(ctx, client, v1, st{}, nil)
	require.NoError(t, err)
	b, err := saga.Start(ctx, client, v2, st2{Label: "x"}, nil)
	require.NoError(t, err)
	b2, err := saga.Start(ctx, client, v2, st2{Label: "y"}, nil)
	require.NoError(t, err)
	counts, err := client.Versions(ctx)
	require.NoError(t, err)
	got := map[int]int64{}
	for _, c := range counts {
		require.Equal(t, "order", c.Name)
		got[c.Version] = c.Running
	}
	require.Equal(t, map[int]int64{1: 1, 2: 2}, got)

	e := v.engine(t, true, v1, v2)
	in := testkit.WaitEnded(t, e, a.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, 1, in.DefinitionVersion)
	require.Equal(t, map[string]int{"v1-a": 1, "v1-b": 1}, v.fx.Counts(t, a.ID))
	for _, id := range []uuid.UUID{b.ID, b2.ID} {
		in := testkit.WaitEnded(t, e, id)
		require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
		require.Equal(t, 2, in.DefinitionVersion)
		require.Equal(t, map[string]int{"v2-a": 1, "v2-b": 1, "v2-d": 1}, v.fx.Counts(t, id))
		var s st2
		require.NoError(t, in.DecodeState(&s))
		require.Equal(t, 3, s.Count)
	}
	counts, err = e.Versions(ctx)
	require.NoError(t, err)
	for _, c := range counts {
		require.Zero(t, c.Running+c.Compensating+c.Failed, "ended sagas are not counted: %+v", c)
	}
}

// CHANGELOG: "a duplicate name and version is refused"; WithVersion's
// bounds: "VersionMax is the highest version a definition may have."
func TestVersionsRegisterRules(t *testing.T) {
	t.Parallel()
	v := newEnv(t)
	e := v.engine(t, false)
	require.ErrorIs(t, e.Register(orderV1(v), orderV1(v)), saga.ErrInvalidDefinition)
	e = v.engine(t, false)
	require.ErrorIs(t, e.Register(orderV2(v), orderV2(v)), saga.ErrInvalidDefinition)
	for _, bad := range []int{-1, saga.VersionMax + 1} {
		e = v.engine(t, false)
		err := e.Register(orderV1(v).WithVersion(bad))
		require.ErrorIs(t, err, saga.ErrInvalidDefinition, "version %d", bad)
	}
	e = v.engine(t, false)
	require.NoError(t, e.Register(orderV1(v).WithVersion(saga.VersionMax)))
}

// doc.go "Versions": "An engine that lacks a saga's version does not claim
// its commands: engines that have it run them, and nothing else waits
// (after Config.UnknownSagaGrace with no such engine, the commands are
// parked as for any saga no engine knows)."
func TestVersionsEngineWithoutOldVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	v1, v2 := orderV1(v), orderV2(v)
	client := v.engine(t, false, v1, v2)
	old, err := saga.Start(ctx, client, v1, st{}, nil)
	require.NoError(t, err)

	cfg := v.config()
	cfg.UnknownSagaGrace = time.Minute
	onlyV2 := v.engineWith(t, cfg, true, orderV2(v))
	fresh, err := saga.Start(ctx, client, v2, st2{}, nil)
	require.NoError(t, err)
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, onlyV2, fresh.ID).Status, "nothing else waits")

	testkit.Hold(t, 1500*time.Millisecond, "the v2-only engine neither runs nor parks the v1 saga", func() bool {
		in := get(t, client, old.ID)
		return len(v.fx.Counts(t, old.ID)) == 0 && in.Status == saga.StatusRunning &&
			events(in, saga.EventCommandParked) == 0
	})
	dead, err := client.DeadMessages(ctx, nil)
	require.NoError(t, err)
	require.Empty(t, dead.Messages)
	require.Zero(t, onlyV2.Stats().Parked)

	withV1 := v.engine(t, true, orderV1(v))
	in := testkit.WaitEnded(t, withV1, old.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, 1, in.DefinitionVersion)
	require.Equal(t, map[string]int{"v1-a": 1, "v1-b": 1}, v.fx.Counts(t, old.ID))
}

// doc.go "Versions": "[MigrateSagas] moves in-flight sagas to another
// version ... with a dry run that computes the same moves and writes
// nothing." MigrateOpts.DryRun: "computes every move and changes nothing."
// Migration.Map: "the dry run and the real run call it alike".
func TestMigrateDryRunMatchesRealRun(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	v1, v2 := orderV1(v), orderV2(v)
	client := v.engine(t, false, v1)
	var ids []uuid.UUID
	for i := range 5 {
		s, err := saga.Start(ctx, client, v1, st{N: 10 + i, Tag: fmt.Sprint("t", i)}, nil)
		require.NoError(t, err)
		ids = append(ids, s.ID)
	}
	m := saga.Migration[st, st2]{From: v1, To: v2,
		Map: func(_ context.Context, _ uuid.UUID, s *st, at saga.Position) (*st2, saga.Position, error) {
			return &st2{Count: s.N, Label: s.Tag}, at, nil
		}}
	dry, err := saga.MigrateSagas(ctx, client, m, &saga.MigrateOpts{DryRun: true})
	require.NoError(t, err)
	require.True(t, dry.DryRun)
	require.Equal(t, 5, dry.Moved)
	for _, id := range ids {
		in := get(t, client, id)
		require.Equal(t, 1, in.DefinitionVersion, "a dry run writes nothing")
		require.Zero(t, events(in, saga.EventSagaMigrated))
	}
	real, err := saga.MigrateSagas(ctx, client, m, nil)
	require.NoError(t, err)
	require.False(t, real.DryRun)
	require.Equal(t, dry.Moved, real.Moved)
	require.Equal(t, dry.Skipped, real.Skipped)
	require.Len(t, real.Moves, len(dry.Moves))
	for i := range dry.Moves {
		d, r := dry.Moves[i], real.Moves[i]
		require.False(t, d.Applied)
		require.True(t, r.Applied)
		r.Applied = false
		require.Equal(t, d.ID, r.ID)
		require.JSONEq(t, string(d.State), string(r.State))
		d.State, r.State = nil, nil
		require.Equal(t, d, r)
		require.Equal(t, 1, r.FromVersion)
		require.Equal(t, 2, r.ToVersion)
	}

	e := v.engine(t, true, orderV2(v))
	for i, id := range ids {
		in := testkit.WaitEnded(t, e, id)
		require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
		require.Equal(t, 2, in.DefinitionVersion)
		require.Equal(t, 1, events(in, saga.EventSagaMigrated))
		var s st2
		require.NoError(t, in.DecodeState(&s))
		require.Equal(t, st2{Count: 10 + i + 3, Label: fmt.Sprint("t", i)}, s)
		require.Equal(t, map[string]int{"v2-a": 1, "v2-b": 1, "v2-d": 1}, v.fx.Counts(t, id))
	}
}

// Migration.Map: "An error skips that saga, with the error as the
// reason." MigrateSagas: "A saga is skipped ... when Map fails or names a
// position To does not have." Nothing says what a panic does; a saga must
// be left as it was either way.
func TestMigrateMapFailsPanicsOrInventsPosition(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	v1, v2 := orderV1(v), orderV2(v)
	client := v.engine(t, false, v1)
	s, err := saga.Start(ctx, client, v1, st{}, nil)
	require.NoError(t, err)
	cases := map[string]func(context.Context, uuid.UUID, *st, saga.Position) (*st2, saga.Position, error){
		"error": func(context.Context, uuid.UUID, *st, saga.Position) (*st2, saga.Position, error) {
			return nil, saga.Position{}, errors.New("refuse this one")
		},
		"no such step": func(context.Context, uuid.UUID, *st, saga.Position) (*st2, saga.Position, error) {
			return &st2{}, fwd("zzz"), nil
		},
		"bad direction": func(context.Context, uuid.UUID, *st, saga.Position) (*st2, saga.Position, error) {
			return &st2{}, saga.Position{Step: "a", Direction: "sideways"}, nil
		},
		"empty position": func(context.Context, uuid.UUID, *st, saga.Position) (*st2, saga.Position, error) {
			return &st2{}, saga.Position{}, nil
		},
		"nil state": func(context.Context, uuid.UUID, *st, saga.Position) (*st2, saga.Position, error) {
			return nil, fwd("a"), nil
		},
	}
	for name, mapFn := range cases {
		for _, dry := range []bool{true, false} {
			res, err := saga.MigrateSagas(ctx, client, saga.Migration[st, st2]{From: v1, To: v2, Map: mapFn},
				&saga.MigrateOpts{DryRun: dry, IDs: []uuid.UUID{s.ID}})
			if err != nil {
				continue // refused as a whole: allowed, as long as nothing moved
			}
			require.Equal(t, 0, res.Moved, "%s dry=%v: %+v", name, dry, res.Moves)
			require.Equal(t, 1, res.Skipped, name)
			require.NotEmpty(t, res.Moves[0].Skipped, name)
			require.False(t, res.Moves[0].Applied, name)
			if name == "error" {
				require.Contains(t, res.Moves[0].Skipped, "refuse this one")
			}
			if name == "no such step" {
				require.Contains(t, res.Moves[0].Skipped, "zzz")
			}
		}
	}
	in := get(t, client, s.ID)
	require.Equal(t, 1, in.DefinitionVersion)
	require.Zero(t, events(in, saga.EventSagaMigrated))

	// The saga still runs on v1.
	e := v.engine(t, true, orderV1(v))
	require.Equal(t, saga.StatusCompleted, testkit.WaitEnded(t, e, s.ID).Status)
	require.Equal(t, map[string]int{"v1-a": 1, "v1-b": 1}, v.fx.Counts(t, s.ID))
}

// MigrateSagas: "A saga is skipped, with the reason in its SagaMove, when a
// step of it runs at that moment (try again)".
func TestMigrateSagaWhoseStepRuns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	g := newGate()
	v1 := saga.Define("order",
		saga.Step[st]{Name: "a", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
			if err := v.fx.Record(ctx, run, "v1-a"); err != nil {
				return err
			}
			return g.wait(ctx)
		}},
		saga.Step[st]{Name: "b", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error {
			return v.fx.Record(ctx, run, "v1-b")
		}})
	v2 := orderV2(v)
	e := v.engine(t, true, v1, v2)
	s, err := saga.Start(ctx, e, v1, st{}, nil)
	require.NoError(t, err)
	g.waitEntered(t)
	m := saga.Migration[st, st2]{From: v1, To: v2,
		Map: func(_ context.Context, _ uuid.UUID, s *st, at saga.Position) (*st2, saga.Position, error) {
			return &st2{Count: s.N}, at, nil
		}}
	for _, dry := range []bool{true, false} {
		res, err := saga.MigrateSagas(ctx, e, m, &saga.MigrateOpts{DryRun: dry, IDs: []uuid.UUID{s.ID}})
		require.NoError(t, err)
		require.Equal(t, 0, res.Moved, "dry=%v %+v", dry, res.Moves)
		require.Len(t, res.Moves, 1)
		require.NotEmpty(t, res.Moves[0].Skipped)
	}
	close(g.release)
	in := testkit.WaitEnded(t, e, s.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, 1, in.DefinitionVersion)
	require.Equal(t, map[string]int{"v1-a": 1, "v1-b": 1}, v.fx.Counts(t, s.ID))
}

// Migrating twice: the second time the saga "is not at m.From's version
// any more" and is skipped (by id), or not selected at all ("otherwise
// every saga of From that has not ended").
func TestMigrateTwice(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	v1, v2 := orderV1(v), orderV2(v)
	client := v.engine(t, false, v1)
	s, err := saga.Start(ctx, client, v1, st{N: 7}, nil)
	require.NoError(t, err)
	m := saga.Migration[st, st2]{From: v1, To: v2,
		Map: func(_ context.Context, _ uuid.UUID, s *st, at saga.Position) (*st2, saga.Position, error) {
			return &st2{Count: s.N}, at, nil
		}}
	res, err := saga.MigrateSagas(ctx, client, m, nil)
	require.NoError(t, err)
	require.Equal(t, 1, res.Moved)
	before := get(t, client, s.ID)

	res, err = saga.MigrateSagas(ctx, client, m, nil)
	require.NoError(t, err)
	require.Equal(t, 0, res.Moved)
	res, err = saga.MigrateSagas(ctx, client, m, &saga.MigrateOpts{IDs: []uuid.UUID{s.ID}})
	require.NoError(t, err)
	require.Equal(t, 0, res.Moved)
	require.Equal(t, 1, res.Skipped)
	require.NotEmpty(t, res.Moves[0].Skipped)

	after := get(t, client, s.ID)
	require.Equal(t, before.Version, after.Version, "the second migration wrote nothing")
	require.Equal(t, 1, events(after, saga.EventSagaMigrated))
	e := v.engine(t, true, orderV2(v))
	in := testkit.WaitEnded(t, e, s.ID)
	require.Equal(t, saga.StatusCompleted, in.Status)
	require.Equal(t, map[string]int{"v2-a": 1, "v2-b": 1, "v2-d": 1}, v.fx.Counts(t, s.ID))
}

// SagaMove.KeyReused: "says that a step with that key committed before
// (the saga ran a step of that name and direction in this epoch): it is not
// run again, the saga goes on past it." doc.go: "The epoch is kept, so a
// step the saga completed under the same name and direction is not run
// again ([SagaMove].KeyReused says so in advance)."
func TestMigrateKeyReusedIsTruthful(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	v1 := orderV1(v, saga.Step[st]{Name: "nap", Wait: saga.Sleep[st](time.Hour)})
	v2 := orderV2(v)
	e := v.engine(t, true, v1, v2)
	back, err := saga.Start(ctx, e, v1, st{}, nil)
	require.NoError(t, err)
	ahead, err := saga.Start(ctx, e, v1, st{}, nil)
	require.NoError(t, err)
	for _, id := range []uuid.UUID{back.ID, ahead.ID} {
		sagatest.Wait(t, e, id, sagatest.Cond("sleep at nap", func(in *saga.Instance) bool {
			return in.Step == "nap" && in.Wait != nil
		}), nil)
	}
	m := saga.Migration[st, st2]{From: v1, To: v2,
		Map: func(_ context.Context, id uuid.UUID, s *st, at saga.Position) (*st2, saga.Position, error) {
			if at != fwd("nap") {
				return nil, saga.Position{}, fmt.Errorf("unexpected position %+v", at)
			}
			if id == back.ID {
				return &st2{Count: s.N}, fwd("b"), nil // b completed already
			}
			return &st2{Count: s.N}, fwd("d"), nil // d never ran
		}}
	opts := &saga.MigrateOpts{IDs: []uuid.UUID{back.ID, ahead.ID}}
	dryOpts := *opts
	dryOpts.DryRun = true
	dry, err := saga.MigrateSagas(ctx, e, m, &dryOpts)
	require.NoError(t, err)
	res, err := saga.MigrateSagas(ctx, e, m, opts)
	require.NoError(t, err)
	require.Equal(t, 2, res.Moved, "%+v", res.Moves)
	byID := map[uuid.UUID]saga.SagaMove{}
	for i, mv := range res.Moves {
		require.Equal(t, dry.Moves[i].KeyReused, mv.KeyReused)
		require.Equal(t, dry.Moves[i].Key, mv.Key)
		byID[mv.ID] = mv
	}
	require.True(t, byID[back.ID].KeyReused, "%+v", byID[back.ID])
	require.True(t, strings.Contains(byID[back.ID].Key, "/b/forward/"), byID[back.ID].Key)
	require.False(t, byID[ahead.ID].KeyReused, "%+v", byID[ahead.ID])

	for _, id := range []uuid.UUID{back.ID, ahead.ID} {
		in := testkit.WaitEnded(t, e, id)
		require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
		require.Equal(t, 2, in.DefinitionVersion)
	}
	// back: b is not run again (v1-b once, v2-b never), then d runs.
	require.Equal(t, map[string]int{"v1-a": 1, "v1-b": 1, "v2-d": 1}, v.fx.Counts(t, back.ID))
	require.Equal(t, map[string]int{"v1-a": 1, "v1-b": 1, "v2-d": 1}, v.fx.Counts(t, ahead.ID))

	// The history entry has both versions and positions.
	in := get(t, e, back.ID)
	for _, ev := range in.History {
		if ev.Type == saga.EventSagaMigrated {
			var detail map[string]any
			require.NoError(t, json.Unmarshal(ev.Detail, &detail))
			require.NotEmpty(t, detail)
		}
	}
}

// doc.go "Versions": "(after Config.UnknownSagaGrace with no such engine,
// the commands are parked as for any saga no engine knows)"; guarantee 8:
// "Bad input is parked, never dropped"; RequeueDead: "A dead outbox row
// becomes pending again". sagatest.Clock.Advance makes the grace pass:
// "the age of a Postgres-only command for a saga or step no engine here
// knows (Config.UnknownSagaGrace)".
func TestVersionsOldVersionParkedAfterGraceThenRequeued(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	v1 := orderV1(v)
	client := v.engine(t, false, v1)
	old, err := saga.Start(ctx, client, v1, st{}, nil)
	require.NoError(t, err)
	cfg := v.config()
	cfg.UnknownSagaGrace = time.Minute
	onlyV2 := v.engineWith(t, cfg, true, orderV2(v))
	require.NoError(t, sagatest.NewClock(v.Pool, v.Schema, onlyV2).Advance(ctx, 2*time.Minute))
	var dead *saga.DeadMessagePage
	testkit.WaitFor(t, 15*time.Second, "the v1 command is parked after the grace", func() bool {
		dead, err = client.DeadMessages(ctx, nil)
		require.NoError(t, err)
		return len(dead.Messages) > 0
	})
	require.Len(t, dead.Messages, 1)
	require.NotNil(t, dead.Messages[0].SagaID)
	require.Equal(t, old.ID, *dead.Messages[0].SagaID)
	require.NotEmpty(t, dead.Messages[0].LastError)
	require.Empty(t, v.fx.Counts(t, old.ID))

	// The v2-only engine is stopped first: while it runs it may claim the
	// requeued command and park it again at once (FINDINGS.md, F3).
	require.NoError(t, onlyV2.Stop(ctx))
	withV1 := v.engine(t, true, orderV1(v))
	rq, err := withV1.RequeueDead(ctx, &saga.RequeueOpts{MessageIDs: []uuid.UUID{dead.Messages[0].ID}})
	require.NoError(t, err)
	require.Len(t, rq.Messages, 1)
	in := testkit.WaitEnded(t, withV1, old.ID)
	require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
	require.Equal(t, map[string]int{"v1-a": 1, "v1-b": 1}, v.fx.Counts(t, old.ID))
}

// Migration.Map is user code. The docs say what an error does ("An error
// skips that saga"), not what a panic does; whatever it does, the saga must
// be left as it was and the other sagas must not be half-migrated.
func TestMigrateMapPanics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	v1, v2 := orderV1(v), orderV2(v)
	client := v.engine(t, false, v1)
	first, err := saga.Start(ctx, client, v1, st{N: 1}, nil)
	require.NoError(t, err)
	second, err := saga.Start(ctx, client, v1, st{N: 2}, nil)
	require.NoError(t, err)
	m := saga.Migration[st, st2]{From: v1, To: v2,
		Map: func(_ context.Context, _ uuid.UUID, s *st, at saga.Position) (*st2, saga.Position, error) {
			if s.N == 2 {
				panic("map bug")
			}
			return &st2{Count: s.N}, at, nil
		}}
	var res *saga.MigrationResult
	var panicked any
	func() {
		defer func() { panicked = recover() }()
		res, err = saga.MigrateSagas(ctx, client, m, &saga.MigrateOpts{IDs: []uuid.UUID{first.ID, second.ID}})
	}()
	t.Logf("Map panic: recovered=%v err=%v res=%+v", panicked, err, res)
	in := get(t, client, second.ID)
	require.Equal(t, 1, in.DefinitionVersion, "the saga whose Map panicked is not moved")
	require.Zero(t, events(in, saga.EventSagaMigrated))
	if panicked == nil && err == nil {
		byID := map[uuid.UUID]saga.SagaMove{}
		for _, mv := range res.Moves {
			byID[mv.ID] = mv
		}
		require.NotEmpty(t, byID[second.ID].Skipped, "a panicking Map skips its saga")
		require.True(t, byID[first.ID].Applied)
	}
	// Whatever happened, each saga is on exactly one version and runs there.
	e := v.engine(t, true, orderV1(v), orderV2(v))
	for _, id := range []uuid.UUID{first.ID, second.ID} {
		in := testkit.WaitEnded(t, e, id)
		require.Equal(t, saga.StatusCompleted, in.Status, sagatest.Describe(in))
		c := v.fx.Counts(t, id)
		if in.DefinitionVersion == 1 {
			require.Equal(t, map[string]int{"v1-a": 1, "v1-b": 1}, c)
		} else {
			require.Equal(t, map[string]int{"v2-a": 1, "v2-b": 1, "v2-d": 1}, c)
		}
	}
}

// Migrating a saga in the middle of a parallel step, one branch completed
// and one waiting an hour for its retry. The docs list what is skipped ("a
// step of it runs ..., that waits for a remote reply or a child saga") and
// a group is none of those; MigrateSagas: "the saga's pending commands of
// the old position are deleted"; doc.go: "a step the saga completed under
// the same name and direction is not run again". So the move goes ahead,
// the held retry goes, and on the new version only the branch that had not
// completed runs: each branch's effect exactly once.
func TestMigrateMidParallelGroup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := newEnv(t)
	mk := func(ver int, failB bool) *saga.Definition[st] {
		return saga.Define("mid-group",
			saga.Step[st]{Name: "grp", Parallel: &saga.Parallel[st]{Branches: []saga.Branch[st]{
				{Name: "a", Action: func(ctx context.Context, run *saga.StepRun, _ st) (any, error) { return 1, v.fx.Record(ctx, run, "a") }},
				{Name: "b", Retry: &saga.RetryPolicy{MaxAttempts: 5, Backoff: func(int) time.Duration { return time.Hour }},
					Action: func(ctx context.Context, run *saga.StepRun, _ st) (any, error) {
						if failB {
							return nil, errors.New("later")
						}
						return 2, v.fx.Record(ctx, run, "b")
					}},
			}}},
			saga.Step[st]{Name: "after", Action: func(ctx context.Context, run *saga.StepRun, _ *st) error { return v.fx.Record(ctx, run, "after") }},
		).WithVersion(ver)
	}
	v1 := mk(1, true)
	v2 := mk(2, false)
	e1 := v.engine(t, true, v1)
	s, err := saga.Start(ctx, e1, v1, st{}, nil)
	require.NoError(t, err)
	sagatest.Wait(t, e1, s.ID, sagatest.Event("step_failed:grp.b"), nil)
	testkit.WaitFor(t, 10*time.Second, "a completes", func() bool { return branchStatus(t, e1, s.ID)["a"].Status == "completed" })
	res, err := saga.MigrateSagas(ctx, e1, saga.Migration[st, st]{From: v1, To: v2,
		Map: func(_ context.Context, _ uuid.UUID, s *st, at saga.Position) (*st, saga.Position, error) {
			return s, at, nil
		}}, nil)
	require.NoError(t, err)
	// doc.go "Versions" (since this review was written): a saga that waits
	// for "its parallel step's branches ... is skipped with the reason".
	require.Equal(t, 0, res.Moved, "%+v", res.Moves)
	require.Len(t, res.Moves, 1)
	require.Contains(t, res.Moves[0].Skipped, "parallel step")
	in, err := e1.Get(ctx, s.ID)
	require.NoError(t, err)
	require.Equal(t, 1, in.DefinitionVersion, "left on its version")
}
