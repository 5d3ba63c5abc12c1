package modcheck_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// otelForbidden are the OpenTelemetry module paths whose packages the
// library must not link: the SDK and the exporters are the application's
// choice. (go.opentelemetry.io/auto/sdk is not the SDK: the API itself
// depends on it, for eBPF auto-instrumentation.)
var otelForbidden = []string{"go.opentelemetry.io/otel/sdk", "go.opentelemetry.io/otel/exporters", "go.opentelemetry.io/contrib"}

// The library's non-test build depends on OpenTelemetry's API only: `go
// list -deps` of every package of the module (commands, benchmarks and
// internal packages included; examples with an OpenTelemetry SDK live in
// modules of their own) names no SDK or exporter package. Tests may use the
// SDK's in-memory recorders.
func TestLibraryLinksNoOpenTelemetrySDK(t *testing.T) {
	t.Parallel()
	root := strings.TrimSpace(goOutput(t, "", nil, "list", "-m", "-f", "{{.Dir}}"))
	deps := goOutput(t, root, nil, "list", "-deps", "-f", "{{.ImportPath}}", "./...")
	var bad []string
	sawAPI := false
	for _, p := range strings.Split(strings.TrimSpace(deps), "\n") {
		if p == "go.opentelemetry.io/otel/trace" {
			sawAPI = true
		}
		for _, f := range otelForbidden {
			if p == f || strings.HasPrefix(p, f+"/") {
				bad = append(bad, p)
			}
		}
	}
	require.True(t, sawAPI, "the check must see the OpenTelemetry API among the dependencies")
	require.Empty(t, bad, "the library's non-test build links OpenTelemetry SDK or exporter packages")
}
