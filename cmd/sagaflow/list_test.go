package main

import (
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/saga"
)

type listDoc struct {
	Sagas      []saga.Instance `json:"sagas"`
	NextCursor string          `json:"next_cursor"`
}

func ids(sagas []saga.Instance) []uuid.UUID {
	out := make([]uuid.UUID, len(sagas))
	for i, in := range sagas {
		out[i] = in.ID
	}
	return out
}

func TestList(t *testing.T) {
	t.Parallel()
	f := setup(t)
	s := f.populate(t)

	t.Run("table", func(t *testing.T) {
		out := f.cli(t, "list", "--status", "failed").ok(t)
		lines := strings.Split(strings.TrimSpace(out), "\n")
		require.Len(t, lines, 3, out) // header and two sagas
		require.Contains(t, out, s.failed1.String())
		require.Contains(t, out, s.failed2.String())
		require.NotContains(t, out, s.completed.String())
		// Columns are aligned: every row has its status where the header has STATUS.
		col := strings.Index(lines[0], "STATUS")
		for _, l := range lines[1:] {
			require.Equal(t, "failed", l[col:col+len("failed")], out)
			require.Contains(t, l, "release_broken")
		}
	})

	t.Run("json", func(t *testing.T) {
		doc := decode[listDoc](t, f.cli(t, "list", "--json"))
		require.ElementsMatch(t, []uuid.UUID{s.completed, s.compensated, s.failed1, s.failed2, s.ping}, ids(doc.Sagas))
		require.Empty(t, doc.NextCursor)

		doc = decode[listDoc](t, f.cli(t, "--json", "list", "--status", "compensated,completed", "--name", "order"))
		require.ElementsMatch(t, []uuid.UUID{s.completed, s.compensated}, ids(doc.Sagas))

		doc = decode[listDoc](t, f.cli(t, "list", "--name", "ping", "--json"))
		require.Equal(t, []uuid.UUID{s.ping}, ids(doc.Sagas))
		require.Equal(t, saga.StatusCompleted, doc.Sagas[0].Status)

		doc = decode[listDoc](t, f.cli(t, "list", "--business-key", "o-declined", "--json"))
		require.Equal(t, []uuid.UUID{s.compensated}, ids(doc.Sagas))
		require.Equal(t, "card_declined", doc.Sagas[0].LastError.Code)
	})

	t.Run("failed step and error code", func(t *testing.T) {
		doc := decode[listDoc](t, f.cli(t, "list", "--failed-step", "reserve", "--error-code", "release_broken", "--json"))
		require.ElementsMatch(t, []uuid.UUID{s.failed1, s.failed2}, ids(doc.Sagas))
		require.Equal(t, &saga.ErrorInfo{Code: "release_broken", Message: "stock service refused the release", Step: "reserve"},
			doc.Sagas[0].LastError)

		doc = decode[listDoc](t, f.cli(t, "list", "--error-code", "card_declined", "--json"))
		require.Equal(t, []uuid.UUID{s.compensated}, ids(doc.Sagas))
	})

	t.Run("pages", func(t *testing.T) {
		var seen []uuid.UUID
		args := []string{"list", "--limit", "2", "--json"}
		for page := 0; ; page++ {
			require.Less(t, page, 3)
			doc := decode[listDoc](t, f.cli(t, args...))
			seen = append(seen, ids(doc.Sagas)...)
			if doc.NextCursor == "" {
				break
			}
			args = []string{"list", "--limit", "2", "--json", "--cursor", doc.NextCursor}
		}
		require.ElementsMatch(t, []uuid.UUID{s.completed, s.compensated, s.failed1, s.failed2, s.ping}, seen)

		out := f.cli(t, "list", "--limit", "1").ok(t)
		require.Contains(t, out, "next page: --cursor ")
	})

	t.Run("no match", func(t *testing.T) {
		require.Equal(t, "no sagas match\n", f.cli(t, "list", "--name", "nothing").ok(t))
		doc := decode[listDoc](t, f.cli(t, "list", "--name", "nothing", "--json"))
		require.NotNil(t, doc.Sagas)
		require.Empty(t, doc.Sagas)
	})

	t.Run("environment", func(t *testing.T) {
		r := runCLI(t, map[string]string{"DATABASE_URL": f.url, "SAGAFLOW_SCHEMA": f.Schema}, "list", "--name", "ping")
		require.Contains(t, r.ok(t), s.ping.String())
	})

	t.Run("bad usage", func(t *testing.T) {
		msg := f.cli(t, "list", "--created-after", "yesterday").failed(t, exitUsage)
		require.Contains(t, msg, "created-after")
		require.Contains(t, msg, `"yesterday"`)
		require.Contains(t, msg, "RFC 3339")

		msg = f.cli(t, "list", "--status", "failed,lost").failed(t, exitUsage)
		require.Contains(t, msg, `unknown status "lost"`)

		msg = f.cli(t, "list", "--cursor", "not-a-cursor").failed(t, exitUsage)
		require.Contains(t, msg, `malformed cursor "not-a-cursor"`)

		msg = f.cli(t, "list", "--limit", "5000").failed(t, exitUsage)
		require.Contains(t, msg, "--limit 5000")

		msg = f.cli(t, "list", "extra").failed(t, exitUsage)
		require.Contains(t, msg, `"extra"`)

		msg = f.cli(t, "list", "--bogus").failed(t, exitUsage)
		require.Contains(t, msg, "bogus")
		require.Contains(t, msg, "Usage: sagaflow list")
	})
}
