package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/saga"
)

// planJSON is a plan as `--plan --json` prints it.
type planJSON struct {
	ID            uuid.UUID    `json:"id"`
	Action        string       `json:"action"`
	FromStep      string       `json:"from_step,omitempty"`
	Version       int64        `json:"version"`
	Epoch         int          `json:"epoch"`
	Runs          []plannedRun `json:"runs"`
	Compensations []plannedRun `json:"compensations"`
	Kept          []string     `json:"kept"`
	Ends          string       `json:"ends"`
	Partial       bool         `json:"partial"`
}

type plannedRun struct {
	Step      string `json:"step"`
	Direction string `json:"direction"`
	Key       string `json:"key"`
	Reused    bool   `json:"reused"`
}

// planOne computes, without acting, what action (with from, for a rerun)
// would do to saga id. The CLI registers no definitions: the steps come
// from the saga's timeline, so steps that never ran are not listed (the
// plan says it is partial).
func planOne(ctx context.Context, c *cli, id uuid.UUID, action saga.PlanAction, from string) (*saga.Plan, error) {
	engine, err := c.connect(ctx)
	if err != nil {
		return nil, err
	}
	inst, err := engine.Get(ctx, id)
	if err != nil {
		return nil, c.opError(err, "plan %s of %s", action, id)
	}
	steps, known := engine.DefinitionSteps(inst.Name)
	if !known {
		steps = saga.HistorySteps(inst)
	}
	plan, err := saga.PlanFor(inst, steps, !known, action, from)
	if err != nil {
		return nil, c.opError(err, "plan %s of %s", action, id)
	}
	return plan, nil
}

// printPlan writes plan of saga id, as text or JSON.
func printPlan(c *cli, id uuid.UUID, from string, plan *saga.Plan) error {
	if c.g.json {
		return writeJSON(c.stdout, planJSON{ID: id, Action: string(plan.Action), FromStep: from, Version: plan.Version, Epoch: plan.Epoch,
			Runs: convRuns(plan.Runs), Compensations: convRuns(plan.Compensations), Kept: append([]string{}, plan.Kept...),
			Ends: string(plan.Ends), Partial: plan.Partial})
	}
	w := c.stdout
	fmt.Fprintf(w, "plan: %s of saga %s (version %d, epoch %d); nothing was changed\n", plan.Action, id, plan.Version, plan.Epoch)
	line := func(title string, rs []saga.PlannedRun) {
		if len(rs) == 0 {
			fmt.Fprintf(w, "  %s: none\n", title)
			return
		}
		fmt.Fprintf(w, "  %s, in order:\n", title)
		for _, r := range rs {
			key := "new key"
			if r.Reused {
				key = "key reused"
			}
			fmt.Fprintf(w, "    %-10s %-24s %s (%s)\n", r.Direction, safetext.Escape(r.Step), safetext.Escape(r.Key.String()), key)
		}
	}
	line("runs", plan.Runs)
	line("compensations if a run fails for good", plan.Compensations)
	if len(plan.Kept) > 0 {
		kept := make([]string, len(plan.Kept))
		for i, k := range plan.Kept {
			kept[i] = safetext.Escape(k)
		}
		fmt.Fprintf(w, "  kept as they are: %s\n", strings.Join(kept, ", "))
	}
	fmt.Fprintf(w, "  ends: %s when everything succeeds\n", plan.Ends)
	if plan.Partial {
		fmt.Fprintln(w, "  (partial: the steps come from the saga's timeline; steps that never ran are not listed)")
	}
	return nil
}

// planBulk is a bulk replay's dry run followed by the plan of each saga it
// would replay: which steps run again and which compensations would run,
// under which keys. It changes nothing.
func planBulk(ctx context.Context, c *cli, o saga.BulkReplayOpts) error {
	engine, err := c.connect(ctx)
	if err != nil {
		return err
	}
	res, err := engine.ReplayBulk(ctx, o)
	if err != nil {
		return c.opError(err, "replay --bulk --plan")
	}
	action := saga.PlanResume
	if o.FromStep != "" {
		action = saga.PlanRerun
	}
	if c.g.json {
		plans := make([]planJSON, 0, len(res.Matched))
		for _, id := range res.Matched {
			p, err := planOne(ctx, c, id, action, o.FromStep)
			if err != nil {
				return err
			}
			plans = append(plans, planJSON{ID: id, Action: string(p.Action), FromStep: o.FromStep, Version: p.Version, Epoch: p.Epoch,
				Runs: convRuns(p.Runs), Compensations: convRuns(p.Compensations), Kept: append([]string{}, p.Kept...),
				Ends: string(p.Ends), Partial: p.Partial})
		}
		return writeJSON(c.stdout, struct {
			Plans []planJSON `json:"plans"`
		}{plans})
	}
	printBulk(c, res, o.FromStep)
	for _, id := range res.Matched {
		p, err := planOne(ctx, c, id, action, o.FromStep)
		if err != nil {
			return err
		}
		if err := printPlan(c, id, o.FromStep, p); err != nil {
			return err
		}
	}
	return nil
}

func convRuns(rs []saga.PlannedRun) []plannedRun {
	out := make([]plannedRun, 0, len(rs))
	for _, r := range rs {
		out = append(out, plannedRun{Step: r.Step, Direction: string(r.Direction), Key: r.Key.String(), Reused: r.Reused})
	}
	return out
}
