package main

import (
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// --plan changes nothing, and what it says would run is what runs.
func TestPlanChangesNothingAndMatchesTheAction(t *testing.T) {
	t.Parallel()
	f := setup(t)
	s := f.populate(t)
	version := func(id uuid.UUID) int {
		return f.Count(t, "SELECT version::int FROM "+f.Table("saga_instances")+" WHERE id = $1", id)
	}
	before := version(s.completed)

	// A rerun of a completed saga from charge: charge and ship run again,
	// under the new epoch's keys.
	rerun := decode[planJSON](t, f.cli(t, "replay", s.completed.String(), "--from-step", "charge", "--plan", "--json"))
	require.Equal(t, "rerun", rerun.Action)
	require.Equal(t, 1, rerun.Epoch)
	var runs []string
	for _, r := range rerun.Runs {
		runs = append(runs, r.Step+"/"+r.Direction)
		require.False(t, r.Reused, "a new epoch means new keys: %s", r.Key)
	}
	require.Equal(t, []string{"charge/forward", "ship/forward"}, runs)
	require.Equal(t, "completed", rerun.Ends)
	require.Equal(t, saga.StatusCompleted, f.status(t, s.completed), "a plan changes nothing")
	require.Equal(t, before, version(s.completed))

	// The text form says the same, and that nothing changed.
	out := f.cli(t, "replay", s.completed.String(), "--from-step", "charge", "--plan").ok(t)
	requireInOrder(t, out, "plan: rerun of saga", "nothing was changed", "charge", "new key", "ship", "ends: completed")

	// A cancel of an ended saga has no plan: the same refusal as the action.
	msg := f.cli(t, "cancel", s.completed.String(), "--plan").failed(t, exitFailed)
	require.Contains(t, msg, "not running")

	// Bulk: the dry run and a plan per saga it would resume.
	bulk := decode[struct {
		Plans []planJSON `json:"plans"`
	}](t, f.cli(t, "replay", "--bulk", "--status", "failed", "--plan", "--json"))
	require.Len(t, bulk.Plans, 2)
	for _, p := range bulk.Plans {
		require.Equal(t, "resume", p.Action)
		require.Equal(t, saga.StatusFailed, f.status(t, p.ID))
	}

	// Act: the rerun runs what the plan said, under the keys it showed.
	f.cli(t, "replay", s.completed.String(), "--from-step", "charge").ok(t)
	e, _, _ := f.engine(t, true)
	testkit.Start(t, e)
	testkit.WaitStatus(t, f.DB, s.completed, saga.StatusCompleted)
	in := decode[saga.Instance](t, f.cli(t, "show", s.completed.String(), "--json"))
	var ran []string
	for _, ev := range in.History {
		if ev.Epoch == 1 && ev.Type == saga.EventStepCompleted {
			ran = append(ran, ev.Step+"/"+string(ev.Direction))
		}
	}
	require.Equal(t, runs, ran, "the plan and the action agree")
	for _, r := range rerun.Runs {
		require.Equal(t, 1, f.Count(t, "SELECT count(*) FROM "+f.Table("inbox")+" WHERE key = $1", r.Key),
			"the planned key %s is the one the step ran under", r.Key)
	}
}
