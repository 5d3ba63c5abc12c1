package readmetest_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/readmetest"
)

// compileTimeout bounds one build of the snippets (a cold build cache
// compiles the module's packages first).
const compileTimeout = 3 * time.Minute

type bundle struct {
	root string
	ix   *readmetest.Index
}

func setup(t *testing.T) *bundle {
	t.Helper()
	wd, err := os.Getwd()
	require.NoError(t, err)
	root, err := readmetest.ModuleRoot(wd)
	require.NoError(t, err)
	ix, err := readmetest.Load(root)
	require.NoError(t, err)
	return &bundle{root: root, ix: ix}
}

func (b *bundle) compile(t *testing.T, d *readmetest.Doc) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), compileTimeout)
	defer cancel()
	return readmetest.Compile(ctx, b.root, d)
}

// TestREADME: the Go blocks of README.md compile, and its inline code names
// only APIs that exist, used as they can be.
func TestREADME(t *testing.T) {
	t.Parallel()
	b := setup(t)
	md, err := os.ReadFile(filepath.Join(b.root, "README.md"))
	require.NoError(t, err)
	d, err := readmetest.Parse("README.md", md)
	require.NoError(t, err)
	require.NotEmpty(t, d.Blocks, "README.md has Go blocks")
	if err := b.compile(t, d); err != nil {
		t.Error(err)
	}
	for _, err := range readmetest.CheckSpans(b.ix, d) {
		t.Error(err)
	}
}

// TestCatchesWhatIsNotThere: the checks fail on snippets that name an API
// the module does not have, or use one wrongly: the two README mistakes of
// issue #11 among them.
func TestCatchesWhatIsNotThere(t *testing.T) {
	t.Parallel()
	b := setup(t)

	t.Run("block", func(t *testing.T) {
		t.Parallel()
		d, err := readmetest.Parse("bad.md", []byte("Intro.\n\n"+
			"<!-- go:func(ctx context.Context, pool *pgxpool.Pool, rl *relay.Relay, h http.Handler) -->\n"+
			"```go\n"+
			"mw := idempotency.New(pool, nil).Wrap(h)\n"+
			"health, err := relay.Health(ctx)\n"+
			"if err != nil { ... }\n"+
			"_, _ = mw, health\n"+
			"```\n"))
		require.NoError(t, err)
		err = b.compile(t, d)
		require.Error(t, err)
		require.Contains(t, err.Error(), "bad.md:5:", "the error is at the file's line")
		require.Contains(t, err.Error(), "idempotency.New")
		require.Contains(t, err.Error(), "bad.md:6:")
	})

	t.Run("block, fixed", func(t *testing.T) {
		t.Parallel()
		d, err := readmetest.Parse("good.md", []byte(
			"<!-- go:func(ctx context.Context, pool *pgxpool.Pool, rl *relay.Relay, h http.Handler) -->\n"+
				"```go\n"+
				"mw, err := idempotency.New(pool, &idempotency.Config{Identity: idempotency.SharedIdentity})\n"+
				"if err != nil { ... }\n"+
				"health, err := rl.Health(ctx)\n"+
				"if err != nil { ... }\n"+
				"_, _ = mw.Wrap(h), health\n"+
				"```\n"))
		require.NoError(t, err)
		require.NoError(t, b.compile(t, d))
	})

	t.Run("stub and declarations", func(t *testing.T) {
		t.Parallel()
		d, err := readmetest.Parse("stub.md", []byte(
			"<!-- go:stub\nfunc charge(context.Context, string) error { return nil }\n-->\n"+
				"```go\nfunc pay(ctx context.Context) error { return charge(ctx, \"o-1\") }\n```\n"+
				"```go\nfunc payTwice(ctx context.Context) error { return errors.Join(pay(ctx), refund(ctx)) }\n```\n"))
		require.NoError(t, err)
		err = b.compile(t, d)
		require.Error(t, err)
		require.Contains(t, err.Error(), "stub.md:8:", "blocks share a package; refund is declared nowhere")
		require.Contains(t, err.Error(), "refund")
	})

	t.Run("inline", func(t *testing.T) {
		t.Parallel()
		d, err := readmetest.Parse("inline.md", []byte(
			"Metrics: `engine.Stats()` and `relay.Health(ctx)`.\n"+
				"Keys: `idempotency.New(pool, cfg).Wrap(handler)`, `saga.NoSuchThing`, `engine.Frobnicate(ctx)`,\n"+
				"`saga.Config{Kafka: &saga.KafkaConfig{Brokers: ...}, Wrokers: 4}`, `&saga.Remote[S]{Topic, Tpye}`.\n"+
				"Prose: `make test`, `saga_id/step`, `--json`, `engine.List(ctx, &saga.ListOpts{...})`.\n"))
		require.NoError(t, err)
		var got []string
		for _, err := range readmetest.CheckSpans(b.ix, d) {
			got = append(got, err.Error())
		}
		require.Equal(t, []string{
			"inline.md:1: `relay.Health(ctx)`: relay.Health is a type, not a function",
			"inline.md:2: `idempotency.New(pool, cfg).Wrap(handler)`: idempotency.New returns 2 results: .Wrap cannot be called on them",
			"inline.md:2: `saga.NoSuchThing`: saga.NoSuchThing does not exist",
			"inline.md:2: `engine.Frobnicate(ctx)`: engine (a saga.Engine) has no field or method Frobnicate",
			"inline.md:3: `saga.Config{Kafka: &saga.KafkaConfig{Brokers: ...}, Wrokers: 4}`: saga.Config has no field Wrokers",
			"inline.md:3: `&saga.Remote[S]{Topic, Tpye}`: saga.Remote has no field Tpye",
		}, got)
	})

	t.Run("malformed", func(t *testing.T) {
		t.Parallel()
		_, err := readmetest.Parse("open.md", []byte("```go\nvar x = 1\n"))
		require.ErrorContains(t, err, "not closed")
		_, err = readmetest.Parse("directive.md", []byte("<!-- go:wrap -->\n"))
		require.ErrorContains(t, err, "unknown directive")
		d, err := readmetest.Parse("syntax.md", []byte("```go\nfunc (\n```\n"))
		require.NoError(t, err)
		err = b.compile(t, d)
		require.ErrorContains(t, err, "syntax.md:2")
		require.False(t, errors.Is(err, context.DeadlineExceeded))
	})
}
