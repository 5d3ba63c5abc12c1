package health

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"time"
)

// Check is one thing a component checked.
type Check struct {
	// Name says what was checked, e.g. "schema" or "listen".
	Name string `json:"name"`
	// OK reports whether the check passed.
	OK bool `json:"ok"`
	// Detail says what was found, or why the check failed.
	Detail string `json:"detail,omitempty"`
}

// Report is a component's health.
type Report struct {
	// Component names the part, e.g. "engine", "relay" or
	// "inbox consumer payments".
	Component string `json:"component"`
	// Live is false when the component should be restarted: it was
	// started, but what it runs has died.
	Live bool `json:"live"`
	// Ready is true when every check passed.
	Ready bool `json:"ready"`
	// Checks are the checks, in a fixed order.
	Checks []Check `json:"checks"`
}

// NewReport returns the report of component from its checks: ready when
// every check passed; live unless dead says otherwise.
func NewReport(component string, dead bool, checks ...Check) Report {
	r := Report{Component: component, Live: !dead, Ready: true, Checks: checks}
	for _, c := range checks {
		if !c.OK {
			r.Ready = false
		}
	}
	return r
}

// Func reports a component's health; saga.Engine.Health, relay.Relay.Check
// and inbox.Consumer.Health are Funcs.
type Func func(ctx context.Context) Report

// TimeoutDefault bounds the checks of one request to a [Handler].
const TimeoutDefault = 5 * time.Second

// Handler serves the reports of funcs: a path ending in "/livez" answers
// 200 when every report is live, one ending in "/readyz" 200 when every
// report is ready, and 503 otherwise; the body is the reports as JSON.
// Other paths are 404 and methods other than GET and HEAD 405. The checks
// run one after another within TimeoutDefault.
func Handler(funcs ...Func) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		live := strings.HasSuffix(r.URL.Path, "/livez") || r.URL.Path == "livez"
		ready := strings.HasSuffix(r.URL.Path, "/readyz") || r.URL.Path == "readyz"
		if !live && !ready {
			http.NotFound(w, r)
			return
		}
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), TimeoutDefault)
		defer cancel()
		reports := make([]Report, 0, len(funcs))
		ok := true
		for _, f := range funcs {
			rep := f(ctx)
			reports = append(reports, rep)
			if (live && !rep.Live) || (ready && !rep.Ready) {
				ok = false
			}
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		if !ok {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		if r.Method == http.MethodHead {
			return
		}
		_ = json.NewEncoder(w).Encode(struct {
			OK      bool     `json:"ok"`
			Reports []Report `json:"reports"`
		}{ok, reports})
	})
}
