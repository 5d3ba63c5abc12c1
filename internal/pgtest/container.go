package pgtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The container step runs the helper program in internal/pgtest/pgcontainer,
// a Go module of its own: it is the only code that needs testcontainers-go,
// and with it Docker's and moby's modules, which must not become
// requirements of the sagaflow module and so of every module that uses it.
// This file only builds the helper, runs it, reads the connection string it
// prints and closes its stdin to make it remove the container.

const (
	// helperDir is the helper's module directory, relative to this file's.
	helperDir = "pgcontainer"
	// helperBuildTimeout bounds building the helper; the first build on a
	// machine downloads and compiles testcontainers and the Docker client.
	helperBuildTimeout = 5 * time.Minute
	// containerStartTimeout bounds the helper's start of the container
	// (image pull included) beyond its own bound, so that a stuck helper
	// cannot hold discovery.
	containerStartTimeout = 4 * time.Minute
	// engineDialTimeout bounds each check that a Docker socket answers.
	engineDialTimeout = time.Second
	// helperExitNoEngine is the helper's exit status when no Docker engine
	// answers.
	helperExitNoEngine = 3
	// dsnPrefix starts the line on which the helper prints the connection
	// string.
	dsnPrefix = "DSN="
)

// errNoDockerEngine marks a container step that failed because no Docker
// engine answers.
var errNoDockerEngine = errors.New("no docker engine answers")

// container is a PostgreSQL container kept by a running helper process.
type container struct {
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	output  *tailBuffer
	dir     string        // temporary directory holding the helper binary
	done    chan struct{} // closed once the helper has exited
	waitErr error         // result of cmd.Wait, valid once done is closed
	connStr string

	stopOnce sync.Once
	stopErr  error
}

// findDockerEngine reports why no Docker engine can answer, or nil when one
// may, so that building and running the helper is worth it. It looks where
// testcontainers looks (DOCKER_HOST, ~/.testcontainers.properties, the
// usual and the rootless Docker sockets) and dials what it can; the helper
// makes the real check.
func findDockerEngine() error {
	var tried []string
	if host := os.Getenv("DOCKER_HOST"); host != "" {
		err := dialDockerHost(host)
		if err == nil {
			return nil
		}
		tried = append(tried, fmt.Sprintf("DOCKER_HOST=%s: %v", host, err))
	} else {
		tried = append(tried, "DOCKER_HOST is not set")
	}
	home, _ := os.UserHomeDir()
	if home != "" {
		if _, err := os.Stat(filepath.Join(home, ".testcontainers.properties")); err == nil {
			return nil // it may name a host; let testcontainers read it
		}
	}
	var missing []string
	for _, path := range dockerSockets(home) {
		if _, err := os.Stat(path); err != nil {
			missing = append(missing, path)
			continue
		}
		if err := dialDockerHost("unix://" + path); err != nil {
			tried = append(tried, fmt.Sprintf("%s: %v", path, err))
			continue
		}
		return nil
	}
	if len(missing) > 0 {
		tried = append(tried, "no socket at "+strings.Join(missing, ", "))
	}
	return fmt.Errorf("pgtest: %w: %s", errNoDockerEngine, strings.Join(tried, "; "))
}

// dockerSockets returns the paths where testcontainers looks for a Docker
// socket when DOCKER_HOST is not set.
func dockerSockets(home string) []string {
	paths := []string{"/var/run/docker.sock"}
	if dir := os.Getenv("XDG_RUNTIME_DIR"); dir != "" {
		paths = append(paths, filepath.Join(dir, "docker.sock"))
	}
	if home != "" {
		paths = append(paths,
			filepath.Join(home, ".docker", "run", "docker.sock"),
			filepath.Join(home, ".docker", "desktop", "docker.sock"))
	}
	return append(paths, filepath.Join("/run/user", strconv.Itoa(os.Getuid()), "docker.sock"))
}

// dialDockerHost checks that a unix or tcp Docker host accepts a
// connection. Other schemes (ssh, npipe) are left to the helper.
func dialDockerHost(host string) error {
	u, err := url.Parse(host)
	if err != nil {
		return err
	}
	var network, address string
	switch u.Scheme {
	case "unix":
		network, address = "unix", u.Path
	case "tcp":
		network, address = "tcp", u.Host
	default:
		return nil
	}
	conn, err := net.DialTimeout(network, address, engineDialTimeout)
	if err != nil {
		return err
	}
	return conn.Close()
}

// helperModule returns the directory of the helper's module, found next to
// this source file.
func helperModule() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("pgtest: cannot locate the pgtest sources to build the container helper")
	}
	dir := filepath.Join(filepath.Dir(file), helperDir)
	if _, err := os.Stat(filepath.Join(dir, "go.mod")); err != nil {
		return "", fmt.Errorf("pgtest: the container helper's module is not at %s (was the test built with -trimpath?): %w", dir, err)
	}
	return dir, nil
}

// buildHelper builds the helper into a new temporary directory and returns
// that directory and the binary's path.
func buildHelper(ctx context.Context) (dir, bin string, err error) {
	module, err := helperModule()
	if err != nil {
		return "", "", err
	}
	dir, err = os.MkdirTemp("", "sagaflow-pgcontainer-")
	if err != nil {
		return "", "", fmt.Errorf("pgtest: build the container helper: %w", err)
	}
	bin = filepath.Join(dir, "pgcontainer")
	ctx, cancel := context.WithTimeout(ctx, helperBuildTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, ".")
	cmd.Dir = module
	cmd.Env = append(os.Environ(), "GOWORK=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		_ = os.RemoveAll(dir)
		return "", "", fmt.Errorf("pgtest: build the container helper in %s: %w%s", module, err, indentTail(string(out), 20))
	}
	return dir, bin, nil
}

// startContainer builds and runs the helper, once a Docker engine may
// answer, and returns the container it started.
func startContainer(ctx context.Context) (*container, error) {
	if err := findDockerEngine(); err != nil {
		return nil, err
	}
	dir, bin, err := buildHelper(ctx)
	if err != nil {
		return nil, err
	}
	return runHelper(ctx, exec.Command(bin), dir)
}

// runHelper starts cmd, the helper, waits for the connection string it
// prints and checks that the server accepts connections. dir is removed
// once the helper has exited.
func runHelper(ctx context.Context, cmd *exec.Cmd, dir string) (*container, error) {
	c := &container{
		cmd:    cmd,
		output: &tailBuffer{},
		dir:    dir,
		done:   make(chan struct{}),
	}
	var err error
	found := make(chan string, 1)
	c.cmd.Stdout = &dsnWriter{found: found, rest: c.output}
	c.cmd.Stderr = c.output
	if c.stdin, err = c.cmd.StdinPipe(); err == nil {
		err = c.cmd.Start()
	}
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("pgtest: run the container helper %s: %w", cmd.Path, err)
	}
	go func() {
		c.waitErr = c.cmd.Wait()
		close(c.done)
	}()

	ctx, cancel := context.WithTimeout(ctx, containerStartTimeout)
	defer cancel()
	exited := false
	select {
	case c.connStr = <-found:
		err = ping(ctx, c.connStr)
	case <-c.done:
		exited = true
		if err = c.exitError(); err == nil {
			err = errors.New("pgtest: the container helper exited without printing a connection string" + indentTail(c.output.String(), 10))
		}
	case <-ctx.Done():
		err = fmt.Errorf("pgtest: the container helper printed no connection string: %w", context.Cause(ctx))
	}
	if err != nil {
		stopErr := c.stop(context.WithoutCancel(ctx))
		if exited {
			stopErr = nil // it only repeats err
		}
		return nil, errors.Join(err, stopErr)
	}
	return c, nil
}

// exitError describes the helper's exit, once done is closed: nil for
// success, else its status and the end of its output.
func (c *container) exitError() error {
	if c.waitErr == nil {
		return nil
	}
	var exit *exec.ExitError
	if errors.As(c.waitErr, &exit) && exit.ExitCode() == helperExitNoEngine {
		return fmt.Errorf("pgtest: %w (container helper: %v)%s", errNoDockerEngine, c.waitErr, indentTail(c.output.String(), 10))
	}
	return fmt.Errorf("pgtest: container helper: %w%s", c.waitErr, indentTail(c.output.String(), 10))
}

// stop closes the helper's stdin, which makes it remove the container, and
// waits until it exits. At ctx's end it kills the helper; testcontainers'
// reaper then removes the container. It is safe to call more than once.
func (c *container) stop(ctx context.Context) error {
	c.stopOnce.Do(func() {
		_ = c.stdin.Close()
		select {
		case <-c.done:
		case <-ctx.Done():
			_ = c.cmd.Process.Kill()
			<-c.done
		}
		c.stopErr = c.exitError()
		if err := os.RemoveAll(c.dir); err != nil {
			c.stopErr = errors.Join(c.stopErr, fmt.Errorf("pgtest: remove the container helper: %w", err))
		}
	})
	return c.stopErr
}

// dsnWriter is the helper's stdout: it sends the connection string of the
// first DSN= line to found and passes every other line to rest.
type dsnWriter struct {
	found chan<- string
	rest  io.Writer
	line  []byte
	sent  bool
}

func (w *dsnWriter) Write(p []byte) (int, error) {
	w.line = append(w.line, p...)
	for {
		i := bytes.IndexByte(w.line, '\n')
		if i < 0 {
			return len(p), nil
		}
		line := string(w.line[:i])
		w.line = w.line[i+1:]
		if dsn, ok := strings.CutPrefix(line, dsnPrefix); ok && !w.sent {
			w.sent = true
			w.found <- dsn
			continue
		}
		_, _ = io.WriteString(w.rest, line+"\n")
	}
}

// tailBuffer keeps the last tailBufferLimit bytes written to it, for error
// messages; it is safe for concurrent use.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
}

// tailBufferLimit bounds what a tailBuffer keeps.
const tailBufferLimit = 64 << 10

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if over := len(b.buf) - tailBufferLimit; over > 0 {
		b.buf = append(b.buf[:0], b.buf[over:]...)
	}
	return len(p), nil
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}
