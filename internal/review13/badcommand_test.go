package review13

import (
	"context"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
)

// counter counts calls per key (see testkit.Counter).
type counter = testkit.Counter

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

// Sagas whose pay Command (run right after pick, in pick's transaction)
// panics, returns what JSON cannot encode, or returns 10 kB of NULs and
// invalid UTF-8, all claimed in ONE batch with healthy sagas: every bad one
// ends with a coded error (compensated, pick once and undone, nothing sent),
// the bad-bytes payload is carried to the participant as JSON carries it,
// and every healthy saga of the batch is sent and completes.
func TestBadCommandsInOneBatchWithHealthyOnes(t *testing.T) {
	t.Parallel()
	r := newRig(t, "badbatch", nil)
	var picks, builds counter
	def := saga.Define("badbatch",
		saga.Step[ord]{Name: "pick", Retry: noBackoff(1),
			Action: func(ctx context.Context, run *saga.StepRun, o *ord) error {
				picks.Add(o.ID)
				if strings.HasPrefix(o.ID, "statebad") {
					o.Note = badBytes()
				}
				return r.fx.Record(ctx, run, "pick")
			},
			Compensate: func(ctx context.Context, run *saga.StepRun, _ *ord) error { return r.fx.Record(ctx, run, "unpick") }},
		saga.Step[ord]{Name: "pay", Timeout: wait, Retry: noBackoff(2), Remote: r.remote(
			func(_ context.Context, _ *saga.StepRun, o *ord) (any, error) {
				builds.Add(o.ID)
				switch {
				case strings.HasPrefix(o.ID, "panic"):
					panic("card vault exploded for " + o.ID)
				case strings.HasPrefix(o.ID, "chan"):
					return map[string]any{"id": o.ID, "c": make(chan int)}, nil
				case strings.HasPrefix(o.ID, "nan"):
					return map[string]any{"id": o.ID, "amount": math.NaN()}, nil
				case strings.HasPrefix(o.ID, "bytes"):
					return payCmd{ID: o.ID, Note: badBytes()}, nil
				}
				return payCmd{ID: o.ID, Note: o.Note}, nil
			})},
	)
	cfg := r.orders.Config()
	cfg.Workers = 1
	cfg.BatchSize = 32
	cfg.RescueInterval = 1e9
	cfg.Kafka = &saga.KafkaConfig{Brokers: r.kc.Addrs()}
	r.engine = testkit.NewEngine(t, r.orders.Pool, cfg, def)

	ctx := context.Background()
	ids := map[string]uuid.UUID{}
	kinds := []string{"ok", "panic", "ok", "chan", "ok", "nan", "ok", "bytes", "ok", "statebad", "ok"}
	for i, k := range kinds {
		id := fmt.Sprintf("%s-%d", k, i)
		st, err := saga.Start(ctx, r.engine, def, ord{ID: id}, nil)
		require.NoError(t, err)
		ids[id] = st.ID
	}
	testkit.Start(t, r.engine) // all of them due at once, for one worker

	for id, sid := range ids {
		in := r.ended(t, sid)
		require.Equal(t, int32(1), picks.Get(id), "%s: pick ran once", id)
		switch {
		case strings.HasPrefix(id, "ok"), strings.HasPrefix(id, "bytes"):
			require.Equal(t, saga.StatusCompleted, in.Status, "%s: %v %+v", id, types(in), in.LastError)
			require.Equal(t, []string{"pay"}, r.calls(t, sid), "%s: the participant ran pay once", id)
			require.Equal(t, []string{"pick"}, r.fx.List(t, sid), id)
			require.Equal(t, int32(1), builds.Get(id), "%s: built once", id)
		case strings.HasPrefix(id, "statebad"):
			// The state pick left cannot be stored: pick fails (documented,
			// CodeStateEncode), its effect rolled back, and pay is not sent.
			require.Equal(t, saga.StatusCompensated, in.Status, "%s: %v %+v", id, types(in), in.LastError)
			require.Equal(t, saga.CodeStateEncode, in.LastError.Code, "%s: %+v", id, in.LastError)
			require.Equal(t, "pick", in.LastError.Step)
			require.Empty(t, r.fx.List(t, sid), id)
			require.Zero(t, r.sentTo(t, sid), "%s: nothing was sent", id)
		default:
			require.Equal(t, saga.StatusCompensated, in.Status, "%s: %v %+v", id, types(in), in.LastError)
			require.NotNil(t, in.LastError, id)
			require.Equal(t, "pay", in.LastError.Step, "%s: %+v", id, in.LastError)
			require.Equal(t, []string{"pick", "unpick"}, r.fx.List(t, sid), "%s: pick kept, then compensated", id)
			require.Zero(t, r.sentTo(t, sid), "%s: nothing was sent", id)
			require.Empty(t, r.calls(t, sid), id)
			if strings.HasPrefix(id, "panic") {
				require.Equal(t, saga.CodePanic, in.LastError.Code, "%s: %+v", id, in.LastError)
				require.Contains(t, in.LastError.Message, "card vault exploded")
			}
			if strings.HasPrefix(id, "chan") || strings.HasPrefix(id, "nan") {
				require.Contains(t, strings.ToLower(in.LastError.Message), "json", "%s: a clear error: %+v", id, in.LastError)
			}
		}
	}
	// The 10 kB of bad bytes reached the participant as JSON carries them:
	// NULs kept (\u0000), each invalid byte as U+FFFD (3 bytes).
	var noteLen int
	require.NoError(t, r.part.Pool.QueryRow(ctx, "SELECT note_len FROM "+r.part.Table("calls")+" WHERE id = 'bytes-7'").Scan(&noteLen))
	require.Equal(t, len(strings.ToValidUTF8(badBytes(), "\uFFFD\uFFFD")), noteLen)
}
