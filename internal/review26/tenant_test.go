package review26_test

import (
	"context"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/ui"
)

// tenantAttack has the UI of tenant a look at, and act on, tenant b's sagas
// and dead items by their ids, and checks that b sees no change and that a's
// pages show nothing of b.
func tenantAttack(t *testing.T, a, b *rig) {
	t.Helper()
	ctx := context.Background()
	// A saga of a's own, so that a's pages have something of type "order".
	mine := a.failed(order{ID: "mine"}, "mine")
	fB := b.failed(order{ID: "theirs"}, "theirs-key")
	wB := b.waiting("theirs-wait")
	dmB := b.deadRow("theirs.topic", "TheirType", "theirs", "their reason", []byte("x"))
	dlB := b.deadLetter("their-consumer", "theirs.topic", "their-msg", "their letter", []byte("k"), []byte("v"), nil)
	before := b.snapshot()
	c := a.client()
	c.get("/")
	tok := c.cookie()

	for _, p := range []string{"/sagas/" + fB.String(), "/sagas/" + fB.String() + "/resume", "/sagas/" + fB.String() + "/rerun?from=charge",
		"/sagas/" + wB.String() + "/cancel", "/sagas/" + wB.String() + "/pause"} {
		res := c.get(p)
		require.Equal(t, 404, res.code, "%s on the other tenant's UI: %s", p, res)
		require.NotContains(t, res.body, `id="confirm-form"`, p)
	}
	for _, p := range []string{"/", "/sagas", "/sagas?key=theirs-key", "/sagas?name=order&status=failed", "/dead", "/replay?status=failed",
		"/requeue?msg=" + dmB.String(), "/requeue?letter=" + strconv.FormatInt(dlB, 10)} {
		res := c.get(p)
		require.Less(t, res.code, 500, p)
		ids := []string{fB.String(), wB.String(), dmB.String()}
		if strings.HasPrefix(p, "/requeue") {
			// The page names the id it was asked about; it must not offer
			// to requeue it.
			ids = nil
			require.NotContains(t, res.body, `id="confirm-form"`, "%s offers to requeue tenant b's item", p)
		}
		for _, s := range append(ids, "theirs.topic", "their reason", "their letter", "their-consumer", "theirs-wait") {
			require.NotContains(t, res.body, s, "%s on tenant a shows tenant b's %q", p, s)
		}
	}
	posts := []struct {
		path string
		vals url.Values
	}{
		{"/sagas/" + fB.String() + "/resume", url.Values{"version": {strconv.FormatInt(b.get(fB).Version, 10)}}},
		{"/sagas/" + fB.String() + "/rerun", url.Values{"version": {strconv.FormatInt(b.get(fB).Version, 10)}, "from": {"charge"}}},
		{"/sagas/" + wB.String() + "/cancel", url.Values{"version": {strconv.FormatInt(b.get(wB).Version, 10)}}},
		{"/sagas/" + wB.String() + "/pause", url.Values{"version": {strconv.FormatInt(b.get(wB).Version, 10)}}},
		{"/requeue", url.Values{"msg": {dmB.String()}}},
		{"/requeue", url.Values{"letter": {strconv.FormatInt(dlB, 10)}}},
		{"/requeue", url.Values{"all": {"1"}, "kind": {"outbox"}}},
		{"/requeue", url.Values{"all": {"1"}, "kind": {"letters"}}},
		{"/replay", url.Values{"status": {"failed"}}},
	}
	for _, p := range posts {
		p.vals.Set("csrf", tok)
		p.vals.Set("reason", "cross-tenant")
		res := c.post(p.path, p.vals)
		require.Less(t, res.code, 500, "%s: %s", p.path, res)
	}
	require.Equal(t, before, b.snapshot(), "acting on tenant a's UI changed tenant b")
	_ = ctx
	_ = mine
}

// TestSecondTenantIsInvisible: two schemas, two engines; the UI of one never
// shows or acts on the other's sagas, even named by their ids.
func TestSecondTenantIsInvisible(t *testing.T) {
	t.Parallel()
	a := newRig(t, &ui.Config{Authorize: allow})
	b := newRig(t, &ui.Config{Authorize: allow})
	tenantAttack(t, a, b)
}

// TestTenantsWhoseSchemasDifferInCase: schema names are quoted in every
// statement (migrations.ValidateSchema); the UI's own queries (overview,
// dead page) must keep "R26…" and "r26…" apart.
func TestTenantsWhoseSchemasDifferInCase(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewSchema(t)
	suffix := strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	upper, lower := "R26Case_"+suffix, "r26case_"+suffix
	ctx := context.Background()
	for _, s := range []string{upper, lower} {
		_, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{s}.Sanitize())
		require.NoError(t, err)
		t.Cleanup(func() {
			_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{s}.Sanitize()+" CASCADE")
		})
	}
	a := newRigOn(t, testkit.Migrate(t, pool, upper), &ui.Config{Authorize: allow}, nil)
	b := newRigOn(t, testkit.Migrate(t, pool, lower), &ui.Config{Authorize: allow}, nil)
	tenantAttack(t, a, b)
	// And the other way round.
	ca := b.client()
	for _, p := range []string{"/", "/dead", "/sagas"} {
		res := ca.get(p)
		require.Less(t, res.code, 500, p)
		require.NotContains(t, res.body, "mine", fmt.Sprintf("%s of %s shows %s's saga", p, lower, upper))
	}
}
