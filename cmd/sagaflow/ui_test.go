package main

import (
	"context"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
)

var servingOn = regexp.MustCompile(`serving the sagaflow UI on (http://\S+/) \(read-only\)`)

// TestUICommand serves the UI read-only on a free port, reads a page, and
// stops when its context is cancelled.
func TestUICommand(t *testing.T) {
	f := setup(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stdout, stderr testkit.Buffer
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"--database-url", f.url, "--schema", f.Schema, "ui", "--listen", "127.0.0.1:0", "--prefix", "/ops"},
			&stdout, &stderr, func(string) string { return "" })
	}()
	deadline := time.Now().Add(30 * time.Second)
	var base string
	for base == "" {
		if m := servingOn.FindStringSubmatch(stdout.String()); m != nil {
			base = m[1]
			break
		}
		select {
		case code := <-done:
			t.Fatalf("ui exited with %d: %s", code, stderr.String())
		default:
		}
		require.True(t, time.Now().Before(deadline), "ui did not start: %s", stderr.String())
		time.Sleep(20 * time.Millisecond)
	}
	require.True(t, strings.HasSuffix(base, "/ops/"))
	resp, err := http.Get(base + "sagas")
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Contains(t, string(body), "read-only")
	// A page whose name points at this address (DNS rebinding) sends its
	// own name as Host: refused. localhost with the port is answered.
	u, err := url.Parse(base)
	require.NoError(t, err)
	for host, want := range map[string]int{"evil.example:" + u.Port(): http.StatusMisdirectedRequest,
		"evil.example": http.StatusMisdirectedRequest, "localhost:" + u.Port(): http.StatusOK, u.Host: http.StatusOK} {
		req, err := http.NewRequest(http.MethodGet, base+"sagas", nil)
		require.NoError(t, err)
		req.Host = host
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, want, resp.StatusCode, "Host %s", host)
	}
	cancel()
	code := testkit.Recv(t, done, 30*time.Second, "ui to stop when its context was cancelled")
	require.Equal(t, exitOK, code, stderr.String())
}

func TestUICommandRefusesArguments(t *testing.T) {
	var stdout, stderr testkit.Buffer
	code := run(context.Background(), []string{"--database-url", "postgres://127.0.0.1:1/x", "ui", "extra"}, &stdout, &stderr,
		func(string) string { return "" })
	require.Equal(t, exitUsage, code, stderr.String())
}
