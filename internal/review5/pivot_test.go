// Package review5_test is an outside reviewer's black-box tests of pivots,
// concurrency keys and the hybrid Kafka mode, from the documentation only.
package review5_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/saga"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

type st struct{ N int }

func noop(context.Context, *saga.StepRun, *st) error { return nil }

// Every documented pivot rule is enforced by Register, with
// ErrInvalidDefinition and an error that names the offending step.
func TestPivotRegistrationRules(t *testing.T) {
	pool, schema := pgtest.NewSchema(t)
	_, err := migrations.Migrate(context.Background(), pool, schema)
	require.NoError(t, err)
	cases := map[string]struct {
		steps []saga.Step[st]
		name  string
	}{
		"two pivots":                {[]saga.Step[st]{{Name: "p1", Action: noop, Pivot: true}, {Name: "p2bad", Action: noop, Pivot: true}}, "p2bad"},
		"pivot with compensate":     {[]saga.Step[st]{{Name: "pcomp", Action: noop, Pivot: true, Compensate: noop}}, "pcomp"},
		"non-retriable after pivot": {[]saga.Step[st]{{Name: "p", Action: noop, Pivot: true}, {Name: "after1", Action: noop}}, "after1"},
		"retriable with compensate": {[]saga.Step[st]{{Name: "p", Action: noop, Pivot: true}, {Name: "rcomp", Action: noop, Retriable: true, Compensate: noop}}, "rcomp"},
		"retriable before pivot":    {[]saga.Step[st]{{Name: "early", Action: noop, Retriable: true}, {Name: "p", Action: noop, Pivot: true}}, "early"},
		"retriable without pivot":   {[]saga.Step[st]{{Name: "a", Action: noop}, {Name: "lonely", Action: noop, Retriable: true}}, "lonely"},
	}
	for label, c := range cases {
		e, err := saga.New(pool, &saga.Config{Schema: schema, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		require.NoError(t, err)
		err = e.Register(saga.Define("d", c.steps...))
		if err == nil {
			t.Errorf("%s: accepted", label)
			continue
		}
		if !errors.Is(err, saga.ErrInvalidDefinition) {
			t.Errorf("%s: %v is not ErrInvalidDefinition", label, err)
		}
		if !strings.Contains(err.Error(), c.name) {
			t.Errorf("%s: %q does not name step %q", label, err, c.name)
		}
	}
}
