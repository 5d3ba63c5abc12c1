package health_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/health"
)

func TestHandler(t *testing.T) {
	t.Parallel()
	ok := func(context.Context) health.Report {
		return health.NewReport("engine", false, health.Check{Name: "schema", OK: true})
	}
	notReady := func(context.Context) health.Report {
		return health.NewReport("relay", false, health.Check{Name: "broker", Detail: "unreachable"})
	}
	dead := func(context.Context) health.Report {
		return health.NewReport("engine", true, health.Check{Name: "workers", Detail: "1 of 2 running"})
	}
	get := func(h http.Handler, method, path string) (int, string) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(method, path, nil))
		return rec.Code, rec.Body.String()
	}
	for _, c := range []struct {
		funcs      []health.Func
		live, read int
	}{
		{[]health.Func{ok}, 200, 200},
		{[]health.Func{ok, notReady}, 200, 503},
		{[]health.Func{dead, ok}, 503, 503},
		{nil, 200, 200},
	} {
		h := health.Handler(c.funcs...)
		code, body := get(h, http.MethodGet, "/healthz/livez")
		require.Equal(t, c.live, code, body)
		code, body = get(h, http.MethodGet, "/healthz/readyz")
		require.Equal(t, c.read, code, body)
		var got struct {
			OK      bool            `json:"ok"`
			Reports []health.Report `json:"reports"`
		}
		require.NoError(t, json.Unmarshal([]byte(body), &got))
		require.Equal(t, c.read == 200, got.OK)
		require.Len(t, got.Reports, len(c.funcs))
		code, body = get(h, http.MethodHead, "/readyz")
		require.Equal(t, c.read, code)
		require.Empty(t, body)
	}
	h := health.Handler(ok)
	code, _ := get(h, http.MethodGet, "/healthz/other")
	require.Equal(t, http.StatusNotFound, code)
	code, _ = get(h, http.MethodPost, "/healthz/readyz")
	require.Equal(t, http.StatusMethodNotAllowed, code)
}

func TestNewReport(t *testing.T) {
	t.Parallel()
	r := health.NewReport("x", false, health.Check{Name: "a", OK: true}, health.Check{Name: "b"})
	require.True(t, r.Live)
	require.False(t, r.Ready)
	require.True(t, health.NewReport("x", false).Ready)
	require.False(t, health.NewReport("x", true).Live)
}
