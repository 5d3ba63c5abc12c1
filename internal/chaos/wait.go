package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/wire"
)

// The waiting workload: a parcel saga whose steps wait, beside the order
// saga, in the same orders engine.
//
//	pack    local:  a ledger row; compensated by another ledger row
//	cool    timer:  waits CoolMS (a few hundred milliseconds)
//	stamp   local:  a ledger row: the effect of the step after the timer
//	prepare parallel (hybrid mode only: Kafka mode has no parallel steps):
//	                the branches box and invoice run at once, each writing
//	                a ledger row and returning a result; each is compensated
//	                by another ledger row; the join copies the results
//	picked  signal: awaits the signal SignalPicked; its handler writes a
//	                ledger row in the step's transaction
//	label   child:  starts a label saga (one step, print, a ledger row) and
//	                waits for its end; its done handler writes a ledger row.
//	                A parcel marked ChildFail has a child that fails for
//	                good: the parent's step fails and the parcel compensates
//	ship    local:  a ledger row
//
// The signals are sent by the nodes' signaller (RoleSignals), not by the
// parent: the parent only writes a request (see [Env.StartParcel]), so that
// the process that sends a signal is one the harness attacks at
// signal.before-commit and signal.after-commit. The signaller is the
// at-least-once sender of the contract: it sends a request's signal, under
// the request's one signal ID, until a send has been acknowledged, and
// then as many more times as the request has Copies (a sender that does
// not know whether its signal went through sends it again). Each request
// has a time before which it is not sent: some signals arrive before their
// parcel reaches the await, some after.
const (
	ParcelSagaName = "parcel"
	LabelSagaName  = "label"
	// SignalPicked is the signal the picked step awaits.
	SignalPicked = "picked"
	// CodeNoLabel is the code of the label's failure, for ChildFail parcels.
	CodeNoLabel = "no_label"
)

// Parcel is the parcel saga's state.
type Parcel struct {
	Key       string `json:"key"`
	CoolMS    int    `json:"cool_ms"`
	ChildFail bool   `json:"child_fail,omitempty"`
	Bin       string `json:"bin,omitempty"`   // from the signal
	Label     string `json:"label,omitempty"` // from the child
	Box       string `json:"box,omitempty"`   // from the join
}

// Label is the child saga's state.
type Label struct {
	Key  string `json:"key"`
	Fail bool   `json:"fail,omitempty"`
	Code string `json:"code,omitempty"`
}

// Picked is the payload of SignalPicked.
type Picked struct {
	Key string `json:"key"`
	Bin string `json:"bin"`
}

// signalID is the one ID of the signal of a parcel: every send of it uses
// this ID.
func signalID(key string) string { return "picked/" + key }

// ParcelDefinitions are the parcel saga and its child; pid goes into the
// ledger rows the process writes. parallel adds the parallel step prepare.
func ParcelDefinitions(pid int, parallel bool) (parcel *saga.Definition[Parcel], label *saga.Definition[Label]) {
	local := func(step string, dir steps.Direction) saga.StepFunc[Parcel] {
		return func(ctx context.Context, run *saga.StepRun, p *Parcel) error {
			return record(ctx, run.Tx, pid, p.Key, step, dir)
		}
	}
	label = saga.Define(LabelSagaName, saga.Step[Label]{Name: "print",
		Action: func(ctx context.Context, run *saga.StepRun, l *Label) error {
			if l.Fail {
				return steps.Permanent(steps.WithCode(CodeNoLabel, errors.New("the printer has no labels")))
			}
			l.Code = "L-" + l.Key
			return record(ctx, run.Tx, pid, l.Key, "print", steps.Forward)
		}})
	branch := func(name string) saga.Branch[Parcel] {
		return saga.Branch[Parcel]{Name: name,
			Action: func(ctx context.Context, run *saga.StepRun, p Parcel) (any, error) {
				return name + "-" + p.Key, record(ctx, run.Tx, pid, p.Key, name, steps.Forward)
			},
			Compensate: func(ctx context.Context, run *saga.StepRun, p Parcel, result json.RawMessage) error {
				var got string
				if err := json.Unmarshal(result, &got); err != nil || got != name+"-"+p.Key {
					return steps.Permanent(fmt.Errorf("chaos: branch %s of parcel %s compensated with result %s", name, p.Key, result))
				}
				return record(ctx, run.Tx, pid, p.Key, name, steps.Compensate)
			}}
	}
	prepare := saga.Step[Parcel]{Name: "prepare", Parallel: &saga.Parallel[Parcel]{
		Branches: []saga.Branch[Parcel]{branch("box"), branch("invoice")},
		Join: func(_ context.Context, _ *saga.StepRun, p *Parcel, results map[string]json.RawMessage) error {
			if len(results) != 2 {
				return steps.Permanent(fmt.Errorf("chaos: parcel %s joined %d results", p.Key, len(results)))
			}
			return json.Unmarshal(results["box"], &p.Box)
		}}}
	first := []saga.Step[Parcel]{
		{Name: "pack", Action: local("pack", steps.Forward), Compensate: local("pack", steps.Compensate)},
		{Name: "cool", Wait: saga.SleepFor(func(p *Parcel) time.Duration { return time.Duration(p.CoolMS) * time.Millisecond })},
		{Name: "stamp", Action: local("stamp", steps.Forward)},
	}
	if parallel {
		first = append(first, prepare)
	}
	parcel = saga.Define(ParcelSagaName, append(first,
		saga.Step[Parcel]{Name: "picked", Wait: saga.OnSignal(SignalPicked,
			func(ctx context.Context, run *saga.StepRun, p *Parcel, in Picked) error {
				if in.Key != p.Key {
					return steps.Permanent(fmt.Errorf("chaos: parcel %s got the signal of %s", p.Key, in.Key))
				}
				p.Bin = in.Bin
				return record(ctx, run.Tx, pid, p.Key, "picked", steps.Forward)
			})},
		saga.Step[Parcel]{Name: "label", Wait: saga.Child(label,
			func(_ context.Context, _ *saga.StepRun, p *Parcel) (Label, *saga.StartOpts, error) {
				return Label{Key: p.Key, Fail: p.ChildFail}, &saga.StartOpts{BusinessKey: p.Key + "/label"}, nil
			},
			func(ctx context.Context, run *saga.StepRun, p *Parcel, l Label) error {
				p.Label = l.Code
				return record(ctx, run.Tx, pid, p.Key, "label", steps.Forward)
			})},
		saga.Step[Parcel]{Name: "ship", Action: local("ship", steps.Forward)},
	)...)
	return parcel, label
}

// signalRequests is the table of the signals the parent asks the nodes to
// send (see the workload above).
func signalRequests() string { return pgx.Identifier{LedgerSchema, "signal_requests"}.Sanitize() }

const signalRequestsDDL = `
CREATE TABLE IF NOT EXISTS %s (
    signal_id  text        PRIMARY KEY,
    order_key  text        NOT NULL,
    copies     integer     NOT NULL,
    not_before timestamptz NOT NULL,
    sends      integer     NOT NULL DEFAULT 0, -- acknowledged sends
    duplicates integer     NOT NULL DEFAULT 0  -- of which the engine said Duplicate
);`

// LoseBranchCommands makes the first command of every parcel's invoice
// branch vanish as it is written (a trigger drops it), as if it had been
// deleted. Nothing but the rescuer runs that branch then: it sends the
// command again once the parcel has not moved for RescueSlack, and the
// crash-point matrix stops it there ([fault.RescueBranchBeforeCommit]).
func (e *Env) LoseBranchCommands(ctx context.Context) error {
	s := OrdersSchema
	_, err := e.Pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+s+`.lost_branch_commands (step_key text PRIMARY KEY);
		CREATE OR REPLACE FUNCTION `+s+`.lose_branch_command() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.type = 'sagaflow.branch' AND NEW.step_key LIKE '%/prepare.invoice/%' THEN
				INSERT INTO `+s+`.lost_branch_commands VALUES (NEW.step_key) ON CONFLICT DO NOTHING;
				IF FOUND THEN
					RETURN NULL;
				END IF;
			END IF;
			RETURN NEW;
		END $$;
		CREATE OR REPLACE TRIGGER lose_branch_command BEFORE INSERT ON `+s+`.outbox
			FOR EACH ROW EXECUTE FUNCTION `+s+`.lose_branch_command();`)
	if err != nil {
		return fmt.Errorf("chaos: lose branch commands: %w", err)
	}
	return nil
}

// StartParcel starts the parcel saga of p, then asks the nodes to send its
// signal copies times (at least once), not before after has passed. Both
// retry while the database is away, as Start does.
func (e *Env) StartParcel(ctx context.Context, p Parcel, copies int, after time.Duration) error {
	e.mu.Lock()
	e.parcels[p.Key] = p
	e.mu.Unlock()
	for {
		_, err := saga.Start(ctx, e.engine, e.parcelDef, p, &saga.StartOpts{BusinessKey: p.Key})
		if err == nil {
			_, err = e.Pool.Exec(ctx, `INSERT INTO `+signalRequests()+` (signal_id, order_key, copies, not_before)
			    VALUES ($1, $2, $3, now() + $4 * interval '1 millisecond') ON CONFLICT DO NOTHING`,
				signalID(p.Key), p.Key, max(copies, 1), after.Milliseconds())
		}
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("chaos: start parcel %s: %w (last error: %v)", p.Key, ctx.Err(), err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// runSignaller sends the requested signals with e until ctx ends (see the
// workload above). With sabotage SabotageLostWakeUp it sends each through
// SignalTx and deletes the signal's wake-up command before the commit; with
// SabotageLostSignal, the signal too.
func runSignaller(ctx context.Context, e *saga.Engine, pool *pgxpool.Pool, log *slog.Logger, sabotage string) {
	lose := sabotage == SabotageLostWakeUp || sabotage == SabotageLostSignal
	type request struct {
		id, key string
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(100 * time.Millisecond):
		}
		rows, err := pool.Query(ctx, `SELECT signal_id, order_key FROM `+signalRequests()+`
		    WHERE sends < copies AND not_before <= now() ORDER BY not_before LIMIT 20`)
		if err != nil {
			continue // the server is away: try again
		}
		reqs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (request, error) {
			var q request
			return q, r.Scan(&q.id, &q.key)
		})
		if err != nil {
			continue
		}
		for _, q := range reqs {
			sig := saga.Signal{Saga: ParcelSagaName, BusinessKey: q.key, Name: SignalPicked, ID: q.id,
				Payload: Picked{Key: q.key, Bin: "bin-" + q.key}}
			var res saga.SignalResult
			if lose {
				err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					var serr error
					if res, serr = e.SignalTx(ctx, tx, sig); serr != nil {
						return serr
					}
					_, serr = tx.Exec(ctx, "DELETE FROM "+OrdersSchema+".outbox WHERE saga_id = $1 AND type = $2 AND status = 'pending'",
						res.SagaID, wire.TypeWake)
					if serr == nil && sabotage == SabotageLostSignal {
						_, serr = tx.Exec(ctx, "DELETE FROM "+OrdersSchema+".saga_signals WHERE saga_id = $1 AND signal_id = $2",
							res.SagaID, q.id)
					}
					return serr
				})
			} else {
				res, err = e.Signal(ctx, sig)
			}
			if err != nil {
				// Not acknowledged: sent again, under the same ID.
				log.WarnContext(ctx, "chaos: signal not sent; it will be sent again", "signal_id", q.id, "err", err)
				continue
			}
			dup := 0
			if res.Duplicate {
				dup = 1
			}
			// Lost if the process dies here: the signal is sent again, a
			// duplicate the engine must recognise.
			_, _ = pool.Exec(ctx, `UPDATE `+signalRequests()+` SET sends = sends + 1, duplicates = duplicates + $2 WHERE signal_id = $1`,
				q.id, dup)
		}
	}
}
