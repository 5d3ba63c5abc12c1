package modcheck_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"go/version"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// modulePath is the module whose hygiene is checked.
const modulePath = "github.com/sagaflow/sagaflow"

// knownPublic are public packages the user module must import at least;
// every other non-internal library package found is imported too.
var knownPublic = []string{
	"saga", "steps", "participant", "wire", "inbox", "relay", "idempotency", "outbox", "kafkaconfig", "migrations", "sagatest", "health",
}

// forbidden are the parts of a module path that must not appear in the
// user module's build list.
var forbidden = []string{"testcontainers", "docker", "moby"}

func TestUserModuleHasNoContainerModules(t *testing.T) {
	t.Parallel()
	root := goOutput(t, "", nil, "list", "-m", "-f", "{{.Dir}}\n{{.GoVersion}}")
	rootDir, goVersion, _ := strings.Cut(strings.TrimSpace(root), "\n")
	pkgs := publicPackages(t, rootDir)
	for _, p := range knownPublic {
		require.Contains(t, pkgs, modulePath+"/"+p, "a public package the check must cover")
	}

	dir := t.TempDir()
	goMod := fmt.Sprintf("module example.com/sagaflowuser\n\ngo %s\n\nrequire %s v0.0.0-00010101000000-000000000000\n\nreplace %s => %s\n",
		goVersion, modulePath, modulePath, rootDir)
	var main strings.Builder
	main.WriteString("// Command sagaflowuser imports every public package of sagaflow.\npackage main\n\nimport (\n")
	for _, p := range pkgs {
		fmt.Fprintf(&main, "\t_ %q\n", p)
	}
	main.WriteString(")\n\nfunc main() {}\n")
	sum, err := os.ReadFile(filepath.Join(rootDir, "go.sum"))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "go.mod"), []byte(goMod), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "main.go"), []byte(main.String()), 0o644))
	// sagaflow's go.sum holds the hashes of every module it can bring in,
	// so that tidying the user module needs no checksum database.
	require.NoError(t, os.WriteFile(filepath.Join(dir, "go.sum"), sum, 0o644))

	env := []string{
		"GOFLAGS=" + strings.TrimSpace(os.Getenv("GOFLAGS")+" -mod=mod"),
		"GOWORK=off",
		"GOTOOLCHAIN=local",
	}
	// The module cache usually holds everything; only if it does not is
	// the proxy asked.
	if _, err := goRun(t, dir, append(env, "GOPROXY=off"), "mod", "tidy"); err != nil {
		t.Logf("go mod tidy from the module cache alone: %v", err)
		if reason := proxyUnreachable(t.Context()); reason != "" {
			t.Skipf("a module is missing from the module cache and the module proxy cannot be reached (%s); run `go mod download` in %s with a network", reason, rootDir)
		}
		goOutput(t, dir, env, "mod", "tidy")
	}
	goOutput(t, dir, env, "build", "-o", os.DevNull, ".")

	list := goOutput(t, dir, env, "list", "-m", "all")
	var bad []string
	for _, line := range strings.Split(strings.TrimSpace(list), "\n") {
		path := strings.ToLower(strings.Fields(line)[0])
		for _, f := range forbidden {
			if strings.Contains(path, f) {
				bad = append(bad, line)
				break
			}
		}
	}
	require.Empty(t, bad, "a module importing %d public packages of sagaflow lists these modules in `go list -m all`:\n%s\n(its build list:\n%s)",
		len(pkgs), strings.Join(bad, "\n"), list)
	t.Logf("a module importing %d public packages lists %d modules, none of %s",
		len(pkgs), strings.Count(strings.TrimSpace(list), "\n")+1, strings.Join(forbidden, ", "))
}

// TestGoDirectiveIsTheDependenciesFloor checks that go.mod's go directive
// asks for no newer Go than the newest go directive among the modules in
// the build list (the go command already refuses an older one): users are
// not made to upgrade Go for nothing. If the code itself ever needs more
// than its dependencies (go vet's stdversion check says so when the
// directive is lowered), say so here.
func TestGoDirectiveIsTheDependenciesFloor(t *testing.T) {
	t.Parallel()
	out := goOutput(t, "", nil, "list", "-m", "-f", "{{if .Main}}main {{end}}{{.Path}} {{.GoVersion}}", "all")
	var main, floor, decidedBy string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(line)
		if f[0] == "main" {
			main = f[2]
			continue
		}
		if len(f) < 2 {
			continue // no go.mod, or no go directive in it
		}
		switch c := gover(f[1], floor); {
		case c > 0:
			floor, decidedBy = f[1], f[0]
		case c == 0:
			decidedBy += ", " + f[0]
		}
	}
	require.NotEmpty(t, main)
	require.Zero(t, gover(main, floor), "go.mod says go %s, but no dependency needs more than go %s (%s): lower the directive", main, floor, decidedBy)
	t.Logf("go %s, decided by %s", main, decidedBy)
}

// gover compares two Go versions as written in go.mod, such as 1.25 and
// 1.26.0.
func gover(a, b string) int { return version.Compare("go"+a, "go"+b) }

// No public package's API names a type of an internal package: what `go
// doc` shows a user holds nothing they cannot name or build themselves.
// (Go lets an exported function return an internal type; this catches it.)
func TestPublicAPINamesNoInternalType(t *testing.T) {
	t.Parallel()
	root := strings.TrimSpace(goOutput(t, "", nil, "list", "-m", "-f", "{{.Dir}}"))
	internalPkgs := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(goOutput(t, root, nil, "list", "-f", "{{.Name}} {{.ImportPath}}", "./internal/...")), "\n") {
		name, _, _ := strings.Cut(line, " ")
		internalPkgs[name] = true
	}
	require.True(t, internalPkgs["store"], "the check must know the internal store")
	var bad []string
	for _, pkg := range publicPackages(t, root) {
		doc := goOutput(t, root, nil, "doc", "-all", pkg)
		for _, line := range strings.Split(doc, "\n") {
			for _, m := range qualified.FindAllStringSubmatch(line, -1) {
				if internalPkgs[m[1]] {
					bad = append(bad, pkg+": "+strings.TrimSpace(line))
				}
			}
		}
	}
	require.Empty(t, bad, "public API that names an internal package's identifier")
}

// qualified matches a package-qualified exported identifier, e.g. store.Saga.
var qualified = regexp.MustCompile(`\b([a-z][a-z0-9]*)\.[A-Z]\w*`)

// publicPackages returns the import paths of the library packages of the
// module in dir that a user can import: not internal, not commands, not
// examples.
func publicPackages(t *testing.T, dir string) []string {
	t.Helper()
	out := goOutput(t, dir, nil, "list", "-f", "{{.ImportPath}} {{.Name}}", "./...")
	var pkgs []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		path, name, _ := strings.Cut(line, " ")
		rel := strings.TrimPrefix(path, modulePath+"/")
		if name == "main" || rel == "internal" || strings.HasPrefix(rel, "internal/") ||
			strings.Contains(rel, "/internal/") || rel == "examples" || strings.HasPrefix(rel, "examples/") {
			continue
		}
		pkgs = append(pkgs, path)
	}
	return pkgs
}

// goRun runs the go command in dir with env added to ours, and returns its
// stdout; the error carries its stderr.
func goRun(t *testing.T, dir string, env []string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("go %s in %s: %w\n%s", strings.Join(args, " "), dir, err, stderr.String())
	}
	return stdout.String(), nil
}

// goOutput is goRun that fails the test on an error.
func goOutput(t *testing.T, dir string, env []string, args ...string) string {
	t.Helper()
	out, err := goRun(t, dir, env, args...)
	require.NoError(t, err)
	return out
}

// proxyUnreachable returns why none of the module proxies in GOPROXY
// answers, or "" when one does (or when GOPROXY allows direct access, which
// cannot be checked in general).
func proxyUnreachable(ctx context.Context) string {
	out, err := exec.CommandContext(ctx, "go", "env", "GOPROXY").Output()
	if err != nil {
		return fmt.Sprintf("go env GOPROXY: %v", err)
	}
	var reasons []string
	for _, p := range strings.FieldsFunc(strings.TrimSpace(string(out)), func(r rune) bool { return r == ',' || r == '|' }) {
		switch p {
		case "off":
			reasons = append(reasons, "GOPROXY=off")
			continue
		case "direct":
			return ""
		}
		if err := get(ctx, p); err != nil {
			reasons = append(reasons, err.Error())
			continue
		}
		return ""
	}
	if len(reasons) == 0 {
		return "GOPROXY is empty"
	}
	return strings.Join(reasons, "; ")
}

// get checks that url answers an HTTP request within five seconds.
func get(ctx context.Context, url string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodHead, url, nil)
	if err != nil {
		return err
	}
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	if err := resp.Body.Close(); err != nil {
		return err
	}
	if resp.StatusCode >= 500 {
		return errors.New(url + ": " + resp.Status)
	}
	return nil
}
