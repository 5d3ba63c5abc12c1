package main

import (
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

func TestReplay(t *testing.T) {
	t.Parallel()
	f := setup(t)
	s := f.populate(t)

	// Refused replays first, while no engine runs.
	msg := f.cli(t, "replay", s.completed.String()).failed(t, exitFailed)
	require.Contains(t, msg, "not replayable")
	require.Contains(t, msg, "status is completed")
	require.Contains(t, msg, "--from-step")

	msg = f.cli(t, "replay", s.completed.String(), "--from-step", "refund").failed(t, exitFailed)
	require.Contains(t, msg, `step "refund"`)

	msg = f.cli(t, "replay", uuid.NewString()).failed(t, exitNotFound)
	require.Contains(t, msg, "no such saga")

	msg = f.cli(t, "replay", "nope").failed(t, exitUsage)
	require.Contains(t, msg, `"nope" is not a UUID`)

	msg = f.cli(t, "replay", s.failed1.String(), "--name", "order", "--dry-run").failed(t, exitUsage)
	require.Contains(t, msg, "--dry-run, --name only apply with --bulk")
	require.Equal(t, saga.StatusFailed, f.status(t, s.failed1))

	// Resume one failed saga where it failed (the compensation of reserve),
	// and re-run the other from charge.
	out := f.cli(t, "replay", s.failed1.String(), "--reason", "release fixed").ok(t)
	require.Contains(t, out, "saga "+s.failed1.String()+" resumes where it failed")
	require.Equal(t, saga.StatusCompensating, f.status(t, s.failed1))

	// A saga that failed while compensating can only re-run from a step
	// after the one whose compensation gave up, which only an engine with
	// the definition can tell: the CLI says so and changes nothing.
	msg = f.cli(t, "replay", s.failed2.String(), "--from-step", "charge").failed(t, exitFailed)
	require.Contains(t, msg, "only an engine that knows saga")
	require.Equal(t, saga.StatusFailed, f.status(t, s.failed2))

	// A completed saga re-runs from charge under a new epoch.
	doc := decode[struct {
		ID               uuid.UUID
		Action, FromStep string
	}](t,
		f.cli(t, "replay", s.completed.String(), "--from-step", "charge", "--json"))
	require.Equal(t, s.completed, doc.ID)
	require.Equal(t, "rerun", doc.Action)
	require.Equal(t, saga.StatusRunning, f.status(t, s.completed))

	// The fix is deployed: an engine with the fixed saga finishes both.
	e, _, _ := f.engine(t, true)
	testkit.Start(t, e)
	testkit.WaitStatus(t, f.DB, s.failed1, saga.StatusCompensated)
	testkit.WaitStatus(t, f.DB, s.completed, saga.StatusCompleted)

	in := decode[saga.Instance](t, f.cli(t, "show", s.completed.String(), "--json"))
	require.Equal(t, 1, in.Epoch)
	requireInOrder(t, f.cli(t, "show", s.completed.String()).ok(t), "saga_completed", "saga_rerun", "charge",
		"step_completed", "charge", "step_completed", "ship", "saga_completed")
	requireInOrder(t, f.cli(t, "show", s.failed1.String()).ok(t), "saga_failed", "saga_resumed", "reserve",
		"compensation_completed", "reserve", "saga_compensated")
}

type bulkDoc struct {
	Matched  []uuid.UUID `json:"matched"`
	Replayed []uuid.UUID `json:"replayed"`
	Errors   []struct {
		ID    uuid.UUID `json:"id"`
		Error string    `json:"error"`
	} `json:"errors"`
	DryRun bool `json:"dry_run"`
}

func TestReplayBulk(t *testing.T) {
	t.Parallel()
	f := setup(t)
	s := f.populate(t)
	before := f.statuses(t)

	t.Run("dry run", func(t *testing.T) {
		out := f.cli(t, "replay", "--bulk", "--dry-run").ok(t)
		require.Contains(t, out, "dry run: 2 sagas match; nothing was changed")
		require.Contains(t, out, "would resume  "+s.failed1.String())
		require.Contains(t, out, "would resume  "+s.failed2.String())
		require.NotContains(t, out, s.compensated.String())

		doc := decode[bulkDoc](t, f.cli(t, "replay", "--bulk", "--dry-run", "--max", "1", "--json"))
		require.True(t, doc.DryRun)
		require.Len(t, doc.Matched, 1)
		require.Contains(t, []uuid.UUID{s.failed1, s.failed2}, doc.Matched[0])
		require.Empty(t, doc.Replayed)
		require.Empty(t, doc.Errors)

		doc = decode[bulkDoc](t, f.cli(t, "replay", "--bulk", "--dry-run", "--status", "completed",
			"--name", "ping", "--from-step", "pong", "--json"))
		require.Equal(t, []uuid.UUID{s.ping}, doc.Matched)

		// A compensated saga cannot resume (see "statuses that never
		// replay are bad usage"); it can re-run.
		doc = decode[bulkDoc](t, f.cli(t, "replay", "--bulk", "--dry-run", "--failed-step", "charge",
			"--error-code", "card_declined", "--status", "compensated", "--from-step", "reserve", "--json"))
		require.Equal(t, []uuid.UUID{s.compensated}, doc.Matched)

		require.Equal(t, before, f.statuses(t), "a dry run changed statuses")
	})

	t.Run("bad usage", func(t *testing.T) {
		msg := f.cli(t, "replay", "--bulk", s.failed1.String()).failed(t, exitUsage)
		require.Contains(t, msg, "unexpected argument")
		msg = f.cli(t, "replay", "--bulk", "--max", "20000").failed(t, exitUsage)
		require.Contains(t, msg, "--max 20000")
		msg = f.cli(t, "replay", "--bulk", "--rate", "-1").failed(t, exitUsage)
		require.Contains(t, msg, "--rate -1")
		msg = f.cli(t, "replay", "--bulk", "--ended-before", "2026-13-01").failed(t, exitUsage)
		require.Contains(t, msg, "ended-before")
		require.Equal(t, before, f.statuses(t))
	})

	t.Run("nothing to do exits 0", func(t *testing.T) {
		out := f.cli(t, "replay", "--bulk", "--dry-run", "--name", "no-such-saga").ok(t)
		require.Equal(t, "dry run: no sagas match; nothing would be replayed\n", out)
		doc := decode[bulkDoc](t, f.cli(t, "replay", "--bulk", "--dry-run", "--name", "no-such-saga", "--json"))
		require.True(t, doc.DryRun)
		require.Empty(t, doc.Matched)
		require.Empty(t, doc.Errors)

		out = f.cli(t, "replay", "--bulk", "--name", "no-such-saga").ok(t)
		require.Equal(t, "no sagas match; nothing was replayed\n", out)
		require.Equal(t, before, f.statuses(t))
	})

	t.Run("statuses that never replay are bad usage", func(t *testing.T) {
		// Reported as issue #11: this dry run printed only "0 sagas
		// match" and exited 1, without saying why.
		for _, dry := range [][]string{{"--dry-run"}, nil} {
			args := append([]string{"replay", "--bulk", "--status", "compensated"}, dry...)
			msg := f.cli(t, args...).failed(t, exitUsage)
			require.Contains(t, msg, "--status compensated: only failed sagas resume")
			require.Contains(t, msg, "pass --from-step")
		}
		msg := f.cli(t, "replay", "--bulk", "--dry-run", "--status", "failed,running", "--from-step", "charge").failed(t, exitUsage)
		require.Contains(t, msg, "--status running: only ended sagas")
		require.Equal(t, before, f.statuses(t))
	})

	t.Run("errors exit 1", func(t *testing.T) {
		// The ping saga has no step "refund": the error is reported, and
		// the exit code says so.
		r := f.cli(t, "replay", "--bulk", "--status", "completed", "--name", "ping", "--from-step", "refund")
		require.Equal(t, exitFailed, r.code, r.stderr)
		require.Empty(t, r.stderr)
		require.Contains(t, r.stdout, "matched 0, replayed 0, errors 1")
		require.Contains(t, r.stdout, "error  "+s.ping.String())
		require.Contains(t, r.stdout, `step "refund"`)
		require.Equal(t, before, f.statuses(t))

		// Its dry run changes nothing and fails nothing (exit 0), and says
		// that the saga would be skipped, as the real run skips it.
		out := f.cli(t, "replay", "--bulk", "--dry-run", "--status", "completed", "--name", "ping", "--from-step", "refund").ok(t)
		require.Contains(t, out, "dry run: 0 sagas match, 1 would be skipped; nothing was changed")
		require.Contains(t, out, `step "refund"`)
	})

	t.Run("replay", func(t *testing.T) {
		doc := decode[bulkDoc](t, f.cli(t, "replay", "--bulk", "--error-code", "release_broken", "--rate", "1000", "--json"))
		require.False(t, doc.DryRun)
		require.ElementsMatch(t, []uuid.UUID{s.failed1, s.failed2}, doc.Replayed)
		require.Empty(t, doc.Errors)
		require.Equal(t, saga.StatusCompensating, f.status(t, s.failed1))
		require.Equal(t, saga.StatusCompensating, f.status(t, s.failed2))
	})
}

func TestCheckBulkStatuses(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		statuses []saga.Status
		from     string
		problem  string
	}{
		{nil, "", ""},
		{nil, "charge", ""},
		{[]saga.Status{saga.StatusFailed}, "", ""},
		{[]saga.Status{saga.StatusFailed, saga.StatusCompleted}, "", "--status completed: only failed sagas resume"},
		{[]saga.Status{saga.StatusRunning, saga.StatusCompensating}, "", "--status running,compensating: only failed"},
		{[]saga.Status{saga.StatusCompleted, saga.StatusCompensated, saga.StatusFailed}, "charge", ""},
		{[]saga.Status{saga.StatusCompleted, saga.StatusCompensating}, "charge", "--status compensating: only ended sagas"},
	} {
		err := checkBulkStatuses(tc.statuses, tc.from)
		if tc.problem == "" {
			require.NoError(t, err, tc)
			continue
		}
		var ce *cliError
		require.ErrorAs(t, err, &ce, tc)
		require.Equal(t, exitUsage, ce.code)
		require.Contains(t, ce.msg, tc.problem)
	}
}
