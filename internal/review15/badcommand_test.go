package review15

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// badBytes is 10 kB of letters with NULs and invalid UTF-8 in it.
func badBytes() string {
	var b strings.Builder
	s := testkit.RandomLetters(10 << 10)
	for i := 0; i < len(s); i += 1000 {
		b.WriteString(s[i:min(i+1000, len(s))])
		b.WriteString("\x00\xff\xfe")
	}
	return b.String()
}

// bill's Command (run in pay's reply's transaction) misbehaves per order,
// for sagas that run side by side with healthy ones on one worker with a
// large batch:
//
//   - retry: a retryable error on its first build, then success;
//   - perm: a permanent error; panic: a panic; chan, nan: a payload JSON
//     cannot encode;
//   - bytes: 10 kB with NULs and invalid UTF-8 (carried as JSON carries it);
//   - txretry: writes "billtx" through run.Tx, then fails once; the second
//     build writes it again and succeeds (one row must be left);
//   - txperm: writes "billtx" through run.Tx, then fails for good (no row);
//   - refusebill: the participant refuses bill.
//
// A failing bill leaves pay completed (OnReply's "paid" kept once: "a
// failure undoes only its own writes, not OnReply's"), pay refunded, pick
// undone, nothing of bill sent, and a coded error on bill.
func TestBadBillCommandsBesideHealthySagas(t *testing.T) {
	t.Parallel()
	r := newRig(t, "badbill", nil)
	var builds counter
	r.billCmd = func(ctx context.Context, run *saga.StepRun, o *ord) (any, error) {
		n := builds.Add(o.ID)
		kind, _, _ := strings.Cut(o.ID, "-")
		switch kind {
		case "retry":
			if n == 1 {
				return nil, errors.New("card vault busy")
			}
		case "perm":
			return nil, steps.Permanent(errors.New("no billing account"))
		case "panic":
			panic("billing exploded for " + o.ID)
		case "chan":
			return map[string]any{"id": o.ID, "c": make(chan int)}, nil
		case "nan":
			return map[string]any{"id": o.ID, "amount": math.NaN()}, nil
		case "bytes":
			return cmd{ID: o.ID, Note: badBytes()}, nil
		case "txretry", "txperm":
			if err := r.fx.Record(ctx, run, "billtx"); err != nil {
				return nil, err
			}
			if kind == "txperm" {
				return nil, steps.Permanent(errors.New("ledger closed"))
			}
			if n == 1 {
				return nil, errors.New("ledger busy")
			}
		}
		return cmd{ID: o.ID, Note: o.Paid}, nil
	}
	def := r.def(2)
	r.start(t, func(cfg *saga.Config) { cfg.Workers = 1; cfg.BatchSize = 32 }, def)

	ctx := context.Background()
	ids := map[string]uuid.UUID{}
	kinds := []string{"ok", "retry", "ok", "perm", "ok", "panic", "ok", "chan", "ok", "nan", "ok", "bytes",
		"ok", "txretry", "ok", "txperm", "ok", "refusebill", "ok"}
	for i, k := range kinds {
		id := fmt.Sprintf("%s-%d", k, i)
		st, err := saga.Start(ctx, r.engine, def, ord{ID: id}, nil)
		require.NoError(t, err)
		ids[id] = st.ID
	}
	for id, sid := range ids {
		in := r.ended(t, sid)
		kind, _, _ := strings.Cut(id, "-")
		require.Equal(t, 1, r.fx.Count(t, sid, "paid"), "%s: OnReply's effect once: %v", id, types(in))
		require.Equal(t, 1, r.fx.Count(t, sid, "pick"), id)
		switch kind {
		case "ok", "retry", "bytes", "txretry":
			require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v %+v", id, types(in), in.LastError)
			require.Equal(t, []string{"pay", "bill"}, r.calls(t, sid), id)
			require.Equal(t, []string{"pick", "paid", "ship"}, without(r.fx.List(t, sid), "billtx"), id)
			require.Equal(t, 1, r.sent(t, sid, "bill"), "%s: bill sent once", id)
			if kind == "txretry" {
				require.Equal(t, 1, r.fx.Count(t, sid, "billtx"), "%s: the failed attempt's write rolled back", id)
			}
			// A batch of replies that cannot simply run (a bad Command
			// beside this one) is given up and run again one message at a
			// time, and this saga's Command with it: built once more per
			// batch given up, its command still sent once (above).
			want := int32(1)
			if kind == "retry" || kind == "txretry" {
				want = 2
			}
			require.GreaterOrEqual(t, builds.Get(id), want, id)
			require.LessOrEqual(t, int64(builds.Get(id)), int64(want)+r.engine.Stats().BusBatchesRerun, id)
		default:
			require.Equal(t, saga.StatusCompensated, in.Status, "%s: %v %+v", id, types(in), in.LastError)
			require.NotNil(t, in.LastError, id)
			require.Equal(t, "bill", in.LastError.Step, "%s: %+v", id, in.LastError)
			testkit.WaitFor(t, wait, id+": pay refunded", func() bool { return len(r.calls(t, sid)) >= 2 })
			want := []string{"pay", "refund"}
			if kind == "refusebill" {
				require.Equal(t, 1, r.sent(t, sid, "bill"), id)
			} else {
				require.Zero(t, r.sent(t, sid, "bill"), "%s: nothing of bill was sent", id)
			}
			require.Equal(t, want, r.calls(t, sid), "%s: %v", id, types(in))
			require.Equal(t, []string{"pick", "paid", "unpick"}, r.fx.List(t, sid), "%s: %v", id, types(in))
			require.Zero(t, r.fx.Count(t, sid, "billtx"), id)
			switch kind {
			case "panic":
				require.Equal(t, saga.CodePanic, in.LastError.Code, "%s: %+v", id, in.LastError)
				require.Contains(t, in.LastError.Message, "billing exploded")
			case "chan", "nan":
				require.Contains(t, strings.ToLower(in.LastError.Message), "json", "%s: %+v", id, in.LastError)
			}
		}
	}
	var noteLen int
	require.NoError(t, r.part.Pool.QueryRow(ctx, "SELECT note_len FROM "+r.part.Table("calls")+" WHERE id = 'bytes-11' AND kind = 'bill'").Scan(&noteLen))
	require.Equal(t, len(strings.ToValidUTF8(badBytes(), "\uFFFD\uFFFD")), noteLen)
}

func without(xs []string, drop string) []string {
	var out []string
	for _, x := range xs {
		if x != drop {
			out = append(out, x)
		}
	}
	return out
}
