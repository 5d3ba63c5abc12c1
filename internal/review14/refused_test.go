package review14

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

// Guarantee 8: an outcome PostgreSQL refuses does not lose the batch. A
// trigger (standing in for a constraint) refuses the history row of one
// saga's chained step; that saga's outcome also carries its wait's end.
// The healthy sagas batched with it (one worker, wake-ups released
// together) complete once each; the refused one is handled as the same
// step after a local one is (the "plain" control): its attempts fail with
// tx_aborted, it compensates, and its wait's end is kept, never doubled.
func TestRefusedOutcomeOfAChainedStep(t *testing.T) {
	t.Parallel()
	for _, plain := range []bool{false, true} {
		t.Run(map[bool]string{false: "chained", true: "plain"}[plain], func(t *testing.T) {
			t.Parallel()
			refusedOutcome(t, plain)
		})
	}
}

func refusedOutcome(t *testing.T, plain bool) {
	r := newRig(t)
	ctx := context.Background()
	refuse := r.db.Table("refuse")
	fn := pgx.Identifier{r.db.Schema, "r14_refuse"}.Sanitize()
	for _, q := range []string{
		"CREATE TABLE " + refuse + " (saga_id uuid PRIMARY KEY)",
		"CREATE FUNCTION " + fn + "() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN " +
			"IF NEW.event = 'step_completed' AND NEW.step_name = 'act' AND EXISTS (SELECT 1 FROM " + refuse + " WHERE saga_id = NEW.saga_id) " +
			"THEN RAISE EXCEPTION 'refused by a check' USING ERRCODE = 'check_violation'; END IF; RETURN NEW; END $$",
		"CREATE TRIGGER r14_refuse BEFORE INSERT ON " + r.db.Table("saga_history") + " FOR EACH ROW EXECUTE FUNCTION " + fn + "()",
	} {
		_, err := r.db.Pool.Exec(ctx, q)
		require.NoError(t, err, q)
	}
	var acts tally
	act := func(ctx context.Context, run *saga.StepRun, o *ord) error {
		acts.add(o.ID)
		return r.fx.Record(ctx, run, "act")
	}
	def := chainDef(r, "refused", chainOpts{actRetry: noBackoff(3), act: act})
	if plain { // the same step after a local one, as a control
		def = saga.Define("refused",
			saga.Step[ord]{Name: "prep", Action: rec(r, "prep"), Compensate: rec(r, "unprep")},
			saga.Step[ord]{Name: "await", Compensate: rec(r, "unawait"), Wait: saga.OnSignal("go", func(ctx context.Context, run *saga.StepRun, s *ord, p string) error {
				return r.fx.Record(ctx, run, "onsig")
			})},
			saga.Step[ord]{Name: "mid", Action: rec(r, "mid")},
			saga.Step[ord]{Name: "act", Action: act, Retry: noBackoff(3)},
		)
	}
	r.start(t, func(c *saga.Config) { c.Workers = 1; c.BatchSize = 16; c.RescueInterval = time.Second }, def)
	names := []string{"h-0", "bad", "h-1", "h-2"}
	ids := map[string]uuid.UUID{}
	for _, n := range names {
		ids[n] = r.startAt(t, def, n, "await")
	}
	_, err := r.db.Pool.Exec(ctx, "INSERT INTO "+refuse+" VALUES ($1)", ids["bad"])
	require.NoError(t, err)
	_, err = r.engine.PauseType(ctx, "refused", "line up")
	require.NoError(t, err)
	for _, n := range names {
		r.signal(t, ids[n], "go", "s", n)
	}
	_, err = r.engine.ResumeType(ctx, "refused")
	require.NoError(t, err)
	for _, n := range names {
		in := r.ended(t, ids[n])
		fx := r.fx.List(t, ids[n])
		require.Equal(t, count(in, "step_completed:await"), r.fx.Count(t, ids[n], "onsig"), n)
		require.LessOrEqual(t, r.fx.Count(t, ids[n], "onsig"), 1, n)
		require.Equal(t, count(in, "step_completed:act"), r.fx.Count(t, ids[n], "act"), n)
		if n == "bad" {
			// Observed, in both forms alike: the refusal counts as a
			// failed attempt of act (tx_aborted), retried, then
			// compensated; the wait's end is kept and compensated.
			require.Equal(t, saga.StatusCompensated, in.Status, describe(in))
			require.Equal(t, "act", in.LastError.Step, describe(in))
			require.Equal(t, saga.CodeTxAborted, in.LastError.Code, describe(in))
			require.Equal(t, 3, count(in, "step_failed:act"), describe(in))
			require.Equal(t, 1, r.fx.Count(t, ids[n], "onsig"))
			require.Equal(t, 1, r.fx.Count(t, ids[n], "unawait"))
			require.Zero(t, r.fx.Count(t, ids[n], "act"))
			continue
		}
		require.Equal(t, saga.StatusCompleted, in.Status, describe(in))
		if plain {
			require.Equal(t, []string{"prep", "onsig", "mid", "act"}, fx)
		} else {
			require.Equal(t, []string{"prep", "onsig", "act"}, fx)
		}
		require.Equal(t, 1, acts.get(n))
	}
}
