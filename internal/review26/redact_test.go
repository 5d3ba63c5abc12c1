package review26_test

import (
	"context"
	"encoding/base64"
	"encoding/hex"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/testkit"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/ui"
)

// leaks reports the forms in which secret shows in body: as it is, in hex
// (with or without spaces, as a hex dump shows it), in base64, escaped.
func leaks(body, secret string) []string {
	var out []string
	hx := hex.EncodeToString([]byte(secret))
	spaced := strings.Join(splitEvery(hx, 2), " ")
	for name, form := range map[string]string{
		"plain":  secret,
		"hex":    hx,
		"dump":   spaced,
		"base64": base64.StdEncoding.EncodeToString([]byte(secret))[:len(secret)],
		"lower":  strings.ToLower(secret),
	} {
		if strings.Contains(strings.ToLower(body), strings.ToLower(form)) {
			out = append(out, name)
		}
	}
	// A hex dump breaks lines every 16 bytes: look for an 8-byte run.
	if len(secret) >= 8 && strings.Contains(body, strings.Join(splitEvery(hex.EncodeToString([]byte(secret[2:8])), 2), " ")) {
		out = append(out, "partial dump")
	}
	return out
}

func splitEvery(s string, n int) []string {
	var out []string
	for len(s) > n {
		out = append(out, s[:n])
		s = s[n:]
	}
	return append(out, s)
}

const (
	stateSecret   = "ST4TE-S3CRET-4242"
	payloadSecret = "P4YL0AD-S3CRET-77"
	letterSecret  = "L3TT3R-S3CRET-99"
	commandSecret = "C0MMAND-S3CRET-55"
)

// crawl fetches every page of the UI a browser can reach from the overview,
// following links and the previews' forms as GET, plus extra paths, and
// returns each body by path.
func crawl(t *testing.T, c *client, extra ...string) map[string]resp {
	t.Helper()
	seen := map[string]resp{}
	queue := append([]string{"/"}, extra...)
	for len(queue) > 0 && len(seen) < 200 {
		p := queue[0]
		queue = queue[1:]
		if _, ok := seen[p]; ok {
			continue
		}
		res := c.get(p)
		seen[p] = res
		for _, h := range hrefs(res.body) {
			u, err := url.Parse(h)
			if err != nil || u.Host != "" || !strings.HasPrefix(u.Path, c.r.prefix+"/") {
				continue
			}
			h = strings.TrimPrefix(u.Path, c.r.prefix)
			if u.RawQuery != "" {
				h += "?" + u.RawQuery
			}
			if _, ok := seen[h]; !ok {
				queue = append(queue, h)
			}
		}
	}
	return seen
}

// TestStateAndPayloadsHiddenWithoutRedact: "Saga state and message payloads
// are shown only through the redaction hooks …; without them they are
// hidden": on no page, preview, result or error page.
func TestStateAndPayloadsHiddenWithoutRedact(t *testing.T) {
	t.Parallel()
	r := newRig(t, &ui.Config{Authorize: allow})
	failed := r.failed(order{ID: "s1", Secret: stateSecret}, "s1")
	done := r.start(r.doneD, order{ID: "s2", Secret: stateSecret}, "s2")
	testkit.WaitEnded(t, r.eng, done)
	w := r.start(r.waitD, order{ID: "s3", Secret: stateSecret}, "s3")
	_, err := r.eng.Signal(context.Background(), saga.Signal{SagaID: w, Name: "go", ID: "sig-1", Payload: map[string]string{"x": payloadSecret}})
	require.NoError(t, err)
	testkit.WaitEnded(t, r.eng, w)
	held := r.waiting("s4")
	dm := r.deadRow("orders.events", "OrderPaid", "k1", "broker refused", []byte(payloadSecret))
	dl := r.deadLetter("billing", "orders.events", "m1", "undecodable", []byte("key"), []byte(letterSecret), nil)
	c := r.client()
	pages := crawl(t, c,
		"/sagas/"+failed.String()+"/resume", "/sagas/"+failed.String()+"/rerun?from=charge", "/sagas/"+done.String()+"/rerun?from=only",
		"/sagas/"+held.String()+"/cancel", "/sagas/"+held.String()+"/pause",
		"/replay?status=failed", "/replay?status=completed&from=only",
		"/requeue?msg="+dm.String(), "/requeue?letter="+strconv.FormatInt(dl, 10),
		"/requeue?all=1&kind=outbox", "/requeue?all=1&kind=letters",
		"/sagas/"+done.String()+"/resume", "/sagas/"+done.String()+"/nope", "/sagas/"+done.String()+"?state=1&show=state",
		"/dead?payloads=1&show=1")
	// The results of actions, and their error pages.
	pages["POST resume"] = c.confirm("/sagas/"+failed.String()+"/resume", nil)
	pages["POST resume again"] = c.post("/sagas/"+failed.String()+"/resume", url.Values{"csrf": {c.cookie()}, "version": {"1"}})
	pages["POST requeue"] = c.confirm("/requeue?msg="+dm.String(), nil)
	pages["POST requeue letter"] = c.confirm("/requeue?letter="+strconv.FormatInt(dl, 10), nil)
	pages["after"] = c.get("/sagas/" + failed.String())
	pages["dead after"] = c.get("/dead?requeued=1")
	for _, accept := range []string{"application/json", "text/plain", "*/*"} {
		pages["json "+accept] = c.do("GET", c.url("/sagas/"+done.String()), nil, map[string]string{"Accept": accept})
	}
	require.Greater(t, len(pages), 15)
	t.Logf("%d pages and responses checked", len(pages))
	for p, res := range pages {
		require.Less(t, res.code, 500, "%s: %s", p, res)
		for _, s := range []string{stateSecret, payloadSecret, letterSecret} {
			require.Empty(t, leaks(res.body, s), "%s shows %s", p, s)
		}
	}
	require.Contains(t, pages["/dead"].body, strconv.Itoa(len(payloadSecret))+" bytes", "the payload's size is shown")
}

// TestRemoteCommandPayloadIsHidden: the timeline shows "commands sent to
// other services", whose payload is built from the state; without
// RedactPayload or Redact it must not show.
func TestRemoteCommandPayloadIsHidden(t *testing.T) {
	t.Parallel()
	d := testkit.NewDB(t)
	def := saga.Define("remote",
		saga.Step[order]{Name: "notify", Remote: &saga.Remote[order]{Topic: "billing.commands", Type: "Charge",
			Command: func(_ context.Context, _ *saga.StepRun, o *order) (any, error) {
				return map[string]string{"card": o.Secret}, nil
			}}, Timeout: time.Hour})
	cfg := d.Config()
	cfg.Kafka = &saga.KafkaConfig{NewReader: testkit.NewSilentReader}
	e, _ := testkit.StartEngine(t, d.Pool, cfg, def)
	st, err := saga.Start(context.Background(), e, def, order{ID: "r1", Secret: commandSecret}, nil)
	require.NoError(t, err)
	testkit.WaitFor(t, 20*time.Second, "the command to be sent", func() bool {
		in, err := e.Get(context.Background(), st.ID)
		require.NoError(t, err)
		return count(in, saga.EventCommandSent) > 0
	})
	h, err := ui.New(d.Pool, e, &ui.Config{Schema: d.Schema, Logger: testkit.Discard})
	require.NoError(t, err)
	r := &rig{t: t, db: d, eng: e}
	r.srv = newServer(t, h)
	c := r.client()
	require.Contains(t, c.get("/sagas/"+st.ID.String()).body, saga.EventCommandSent, "the timeline shows the command")
	for p, res := range crawl(t, c, "/sagas/"+st.ID.String()) {
		require.Less(t, res.code, 500, p)
		require.Empty(t, leaks(res.body, commandSecret), "%s shows the command's payload", p)
	}
}

// TestRedactHooksDecideWhatIsShown: Redact's result is what is shown of the
// state; RedactPayload gets "its first PreviewBytes bytes" and the topic,
// and only its result is shown.
func TestRedactHooksDecideWhatIsShown(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var redactNames []string
	var payloadArgs []string
	maxLen := 0
	r := newRig(t, &ui.Config{
		Redact: func(name string, state []byte) []byte {
			mu.Lock()
			defer mu.Unlock()
			redactNames = append(redactNames, name)
			if strings.Contains(string(state), "hide-me") {
				return nil
			}
			return []byte(`{"shown":"VISIBLE-PART"}`)
		},
		RedactPayload: func(topic string, p []byte) []byte {
			mu.Lock()
			defer mu.Unlock()
			payloadArgs = append(payloadArgs, topic+"="+string(p))
			maxLen = max(maxLen, len(p))
			return p[:min(4, len(p))]
		},
		PreviewBytes: 16,
	})
	shown := r.failed(order{ID: "v1", Secret: stateSecret}, "v1")
	hidden := r.failed(order{ID: "hide-me", Secret: stateSecret}, "v2")
	r.deadRow("orders.events", "OrderPaid", "k", "x", []byte("ABCDEFGHIJKLMNOPQRSTUVWXYZ-"+payloadSecret))
	r.deadLetter("billing", "letters.topic", "m", "y", []byte("k"), []byte("abcdefghijklmnopqrstuvwxyz-"+letterSecret), nil)
	c := r.client()
	p := c.get("/sagas/" + shown.String())
	require.Contains(t, p.body, "VISIBLE-PART")
	require.Empty(t, leaks(p.body, stateSecret))
	p = c.get("/sagas/" + hidden.String())
	require.NotContains(t, p.body, "VISIBLE-PART")
	require.Empty(t, leaks(p.body, stateSecret))
	dead := c.get("/dead")
	require.Contains(t, dead.body, "ABCD")
	require.Contains(t, dead.body, "abcd")
	for _, s := range []string{"EFGH", "efgh", payloadSecret, letterSecret} {
		require.Empty(t, leaks(dead.body, s), "the dead page shows %q, which RedactPayload cut", s)
	}
	mu.Lock()
	defer mu.Unlock()
	require.Contains(t, redactNames, "order")
	require.LessOrEqual(t, maxLen, 16, "RedactPayload got more than PreviewBytes: %q", payloadArgs)
	require.Contains(t, payloadArgs, "orders.events=ABCDEFGHIJKLMNOP")
	require.Contains(t, payloadArgs, "letters.topic=abcdefghijklmnop")
}
