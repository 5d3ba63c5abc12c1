package review34_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
)

// crashRig is a schema with an effects table and a two-step saga "xfer"
// (debit, credit) that writes one row per step, in run.Tx or, leaky, with
// the pool.
type crashRig struct {
	pool   *pgxpool.Pool
	schema string
	fx     string
	def    *saga.Definition[order]
}

func newCrashRig(t *testing.T, name string, leakyStep string) *crashRig {
	t.Helper()
	r := &crashRig{}
	r.pool, r.schema = pgtest.Migrated(t)
	r.fx = pgx.Identifier{r.schema, "r34_fx"}.Sanitize()
	if _, err := r.pool.Exec(context.Background(), "CREATE TABLE "+r.fx+" (saga uuid NOT NULL, step text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	write := func(step string) saga.StepFunc[order] {
		return func(ctx context.Context, run *saga.StepRun, _ *order) error {
			q := "INSERT INTO " + r.fx + " VALUES ($1, $2)"
			if step == leakyStep {
				_, err := r.pool.Exec(ctx, q, run.SagaID, step)
				return err
			}
			_, err := run.Tx.Exec(ctx, q, run.SagaID, step)
			return err
		}
	}
	r.def = saga.Define(name,
		saga.Step[order]{Name: "debit", Action: write("debit")},
		saga.Step[order]{Name: "credit", Action: write("credit")})
	return r
}

func (r *crashRig) opts(cfg *saga.Config) *sagatest.CrashOpts {
	if cfg == nil {
		cfg = &saga.Config{}
	}
	cfg.Schema = r.schema
	if cfg.Logger == nil {
		cfg.Logger = discard
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 50 * time.Millisecond
	}
	return &sagatest.CrashOpts{
		Config: cfg,
		Sagas:  2,
		Start: func(ctx context.Context, e *saga.Engine, rd sagatest.Round, i int) (uuid.UUID, error) {
			st, err := saga.Start(ctx, e, r.def, order{ID: fmt.Sprintf("%s-%d", rd, i)}, nil)
			return st.ID, err
		},
		Effects: func(ctx context.Context, in *saga.Instance) (map[sagatest.Effect]int, error) {
			out := map[sagatest.Effect]int{{Step: "debit"}: 0, {Step: "credit"}: 0}
			rows, err := r.pool.Query(ctx, "SELECT step, count(*) FROM "+r.fx+" WHERE saga = $1 GROUP BY step", in.ID)
			if err != nil {
				return nil, err
			}
			defer rows.Close()
			for rows.Next() {
				var s string
				var n int
				if err := rows.Scan(&s, &n); err != nil {
					return nil, err
				}
				out[sagatest.Effect{Step: s}] = n
			}
			return out, rows.Err()
		},
		Timeout: 20 * time.Second,
	}
}

// TestCrashMatrixNeverPassesWithoutCrashing: a matrix whose rounds crash
// nothing (a boundary the mode never crosses, a crossing never reached)
// must say so, not pass as if the saga survived crashes; options out of
// range must be refused by name.
func TestCrashMatrixNeverPassesWithoutCrashing(t *testing.T) {
	cases := []struct {
		name string
		mod  func(*sagatest.CrashOpts)
		// kind: "refused" (must fail naming want), "nothing" (crashes
		// nothing: must not fail, and must report it, naming want),
		// "lenient" (may fail naming want, or run with the default).
		kind string
		want string
	}{
		{"AfterHold in Postgres-only mode", func(o *sagatest.CrashOpts) { o.Boundaries = []sagatest.Boundary{sagatest.AfterHold} }, "nothing", "engine.after-hold"},
		{"crossing never reached", func(o *sagatest.CrashOpts) {
			o.Boundaries = []sagatest.Boundary{sagatest.AfterCommit}
			o.Crossings = []int{1 << 30}
		}, "nothing", "engine.after-commit"},
		{"crossing 0", func(o *sagatest.CrashOpts) { o.Crossings = []int{0} }, "refused", "Crossings"},
		{"crossing -1", func(o *sagatest.CrashOpts) { o.Crossings = []int{-1} }, "refused", "Crossings"},
		{"negative sagas", func(o *sagatest.CrashOpts) {
			o.Sagas = -1
			o.Boundaries = []sagatest.Boundary{sagatest.AfterCommit}
			o.Crossings = []int{1}
		}, "lenient", "Sagas"},
		{"negative timeout", func(o *sagatest.CrashOpts) {
			o.Timeout = -time.Second
			o.Boundaries = []sagatest.Boundary{sagatest.AfterCommit}
			o.Crossings = []int{1}
		}, "lenient", "Timeout"},
		{"empty boundary", func(o *sagatest.CrashOpts) { o.Boundaries = []sagatest.Boundary{""} }, "refused", "oundar"},
		{"boundary in upper case", func(o *sagatest.CrashOpts) { o.Boundaries = []sagatest.Boundary{"ENGINE.AFTER-CLAIM"} }, "refused", "ENGINE.AFTER-CLAIM"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := newCrashRig(t, "xfer", "")
			opts := r.opts(nil)
			c.mod(opts)
			f := newFake(t)
			o := call(50*time.Second, func() { sagatest.CrashMatrix(f, r.pool, r.def, opts) })
			t.Logf("took %v failed=%v skipped=%v exited=%v: %.600s\nlogged: %.1500s", o.took.Round(time.Millisecond),
				f.Failed(), f.Skipped(), o.exited, f.messages(), f.logged())
			if o.panicked != nil {
				t.Fatalf("CrashMatrix panicked: %v", o.panicked)
			}
			if o.hung {
				t.Fatalf("CrashMatrix hung")
			}
			switch c.kind {
			case "refused":
				if !f.Failed() {
					t.Fatalf("CrashMatrix took %s without failing", c.name)
				}
				if !strings.Contains(f.messages(), c.want) {
					t.Errorf("the failure does not name %q: %.600s", c.want, f.messages())
				}
			case "nothing":
				if f.Failed() {
					t.Fatalf("a correct saga failed: %s", f.messages())
				}
				// Not a *testing.T, so no subtest to skip: the report is a log
				// line that names the boundary and says nothing was crashed.
				if all := f.messages() + f.logged(); !strings.Contains(all, c.want) || !strings.Contains(all, "nothing") {
					t.Errorf("a round that crashed nothing is not reported: %.1500s", all)
				}
			case "lenient":
				if f.Failed() && !strings.Contains(f.messages(), c.want) {
					t.Errorf("the failure does not name %q: %.600s", c.want, f.messages())
				}
				if !f.Failed() && !strings.Contains(f.logged(), "crashed at crossing 1") {
					t.Errorf("the matrix neither failed nor crashed: %.1500s", f.logged())
				}
			}
		})
	}
}

// TestCrashMatrixKafkaMode: in Kafka mode (the docs: "and in Kafka mode
// AfterHold"), a correct saga passes the matrix and one whose second step
// writes with the pool fails it.
func TestCrashMatrixKafkaMode(t *testing.T) {
	for _, leaky := range []string{"", "credit"} {
		name := "correct"
		if leaky != "" {
			name = "leaky " + leaky
		}
		t.Run(name, func(t *testing.T) {
			r := newCrashRig(t, "xferk", leaky)
			kc := kafkatest.New(t, kafkatest.SeedTopics(2, "r34.commands.xferk"), kafkatest.AllowAutoTopicCreation(),
				kafkatest.GroupMinSessionTimeout(time.Second))
			w := relay.NewKafkaWriter(kc.Addrs(), nil)
			t.Cleanup(func() { w.Close() })
			rl, err := relay.New(r.pool, w, &relay.Config{Schema: r.schema, PollInterval: 50 * time.Millisecond, Logger: discard})
			if err != nil {
				t.Fatal(err)
			}
			if err := rl.Start(context.Background()); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				_ = rl.Stop(ctx)
			})
			opts := r.opts(&saga.Config{CommandTopic: "r34.commands", Kafka: &saga.KafkaConfig{
				Brokers: kc.Addrs(), AllSteps: true, SessionTimeout: 2 * time.Second}})
			opts.Boundaries = []sagatest.Boundary{sagatest.AfterHandler, sagatest.AfterCommit, sagatest.AfterHold}
			opts.Crossings = []int{1, 3}
			f := newFake(t)
			o := call(110*time.Second, func() { sagatest.CrashMatrix(f, r.pool, r.def, opts) })
			t.Logf("took %v failed=%v skipped=%v: %.1500s", o.took.Round(time.Millisecond), f.Failed(), f.Skipped(), f.messages())
			if o.panicked != nil || o.hung {
				t.Fatalf("CrashMatrix: %+v", o)
			}
			if leaky == "" && f.Failed() {
				t.Fatalf("a correct saga failed the Kafka-mode matrix: %.3000s", f.messages())
			}
			if leaky != "" {
				if !f.Failed() {
					t.Fatalf("a leaky saga passed the Kafka-mode matrix")
				}
				if !strings.Contains(f.messages(), "step credit") {
					t.Errorf("the failure does not name the doubled effect (step credit): %.1500s", f.messages())
				}
			}
		})
	}
}
