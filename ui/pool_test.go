package ui_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/ui"
)

// TestActionsOnAOneConnectionPool: an action takes one connection of the
// pool, not one for its lock and another for its work. On a pool of one
// connection an action that waited for a second would wait until its
// request ended (and as many confirmations at once as a pool has
// connections would starve it).
func TestActionsOnAOneConnectionPool(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	pool := pgtest.RecentPool(t, 1)
	// An operator tool's engine: no definitions, not started.
	engine, err := saga.New(pool, &saga.Config{Schema: f.schema, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	cfg := writable()
	cfg.Schema = f.schema
	cfg.Logger = slog.New(slog.DiscardHandler)
	h, err := ui.New(pool, engine, cfg)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	c := client(t)
	c.Timeout = 30 * time.Second

	act := func(t *testing.T, id, action string, extra url.Values) {
		t.Helper()
		code, page, _ := get(t, c, srv.URL+"/sagas/"+id+"/"+action+"?"+extra.Encode())
		require.Equal(t, http.StatusOK, code, page)
		form := url.Values{"csrf": {formToken(t, page)}, "version": {formVersion(t, page)}}
		for k, v := range extra {
			form[k] = v
		}
		code, body, _ := post(t, c, srv.URL+"/sagas/"+id+"/"+action, form, nil)
		require.Equal(t, http.StatusSeeOther, code, body)
	}

	t.Run("rerun", func(t *testing.T) {
		act(t, f.completed.String(), "rerun", url.Values{"from": {"charge"}})
		inst := f.waitUntil(t, f.completed, func(in *saga.Instance) bool {
			return in.Epoch == 1 && in.Status == saga.StatusCompleted
		}, "completed again in epoch 1")
		require.True(t, hasReason(inst, saga.EventSagaRerun, "rerun by alice in the web UI"), "%+v", inst.History)
	})
	t.Run("pause and unpause", func(t *testing.T) {
		s, err := saga.Start(ctx, f.engine, f.approve, order{ID: "p"}, &saga.StartOpts{BusinessKey: "pool-pause"})
		require.NoError(t, err)
		f.waitUntil(t, s.ID, func(in *saga.Instance) bool { return in.Wait != nil }, "waiting")
		act(t, s.ID.String(), "pause", nil)
		f.waitUntil(t, s.ID, func(in *saga.Instance) bool { return in.Paused != nil }, "paused")
		act(t, s.ID.String(), "unpause", nil)
		f.waitUntil(t, s.ID, func(in *saga.Instance) bool { return in.Paused == nil }, "unpaused")
	})
	t.Run("resume", func(t *testing.T) {
		f.failCharge.Store(true)
		f.failRelease.Store(true)
		id := f.start(t, "pool-resume", "x")
		f.waitStatus(t, id, saga.StatusFailed)
		f.failCharge.Store(false)
		f.failRelease.Store(false)
		act(t, id.String(), "resume", nil)
		f.waitStatus(t, id, saga.StatusCompensated)
	})
	t.Run("cancel", func(t *testing.T) {
		s, err := saga.Start(ctx, f.engine, f.approve, order{ID: "c"}, &saga.StartOpts{BusinessKey: "pool-cancel"})
		require.NoError(t, err)
		f.waitUntil(t, s.ID, func(in *saga.Instance) bool { return in.Wait != nil }, "waiting")
		act(t, s.ID.String(), "cancel", nil)
		f.waitStatus(t, s.ID, saga.StatusCompensated)
	})
}

// TestOneSagaSpelledTwoWaysActsOnce: the per-saga lock is the saga's, not
// the spelling of its id in the path (upper case and urn:uuid: parse as
// the same saga): confirmations of one preview posted at once under
// several spellings act once.
func TestOneSagaSpelledTwoWaysActsOnce(t *testing.T) {
	f := newFixture(t)
	srv := f.server(t, writable())
	s, err := saga.Start(context.Background(), f.engine, f.approve, order{ID: "sp"}, &saga.StartOpts{BusinessKey: "spelled"})
	require.NoError(t, err)
	f.waitUntil(t, s.ID, func(in *saga.Instance) bool { return in.Wait != nil }, "waiting")
	c := client(t)
	code, page, _ := get(t, c, srv.URL+"/sagas/"+s.ID.String()+"/cancel")
	require.Equal(t, http.StatusOK, code, page)
	form := url.Values{"csrf": {formToken(t, page)}, "version": {formVersion(t, page)}}
	spellings := []string{s.ID.String(), strings.ToUpper(s.ID.String()), "urn:uuid:" + s.ID.String(), strings.ToUpper(s.ID.String())}
	codes := make([]int, len(spellings))
	var wg sync.WaitGroup
	for i, sp := range spellings {
		wg.Go(func() { codes[i], _, _ = post(t, c, srv.URL+"/sagas/"+sp+"/cancel", form, nil) })
	}
	wg.Wait()
	acted := 0
	for _, code := range codes {
		switch code {
		case http.StatusSeeOther:
			acted++
		case http.StatusConflict:
		default:
			t.Fatalf("a confirmation got %d (all: %v)", code, codes)
		}
	}
	require.Equal(t, 1, acted, "codes %v", codes)
	inst := f.waitStatus(t, s.ID, saga.StatusCompensated)
	n := 0
	for _, ev := range inst.History {
		if ev.Type == saga.EventCancelRequested {
			n++
		}
	}
	require.Equal(t, 1, n, "one cancel recorded: %v", inst.History)
}
