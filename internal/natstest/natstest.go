// Package natstest runs throwaway NATS servers with JetStream for tests:
// each on a free loopback port with a store directory of its own, so a test
// can kill and restart its server without touching anyone else's (nor the
// machine's own server).
//
// The server binary is NATS_SERVER_BIN when set, else nats-server on the
// PATH, else /usr/sbin/nats-server.
package natstest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// readyTimeout bounds a server's start.
const readyTimeout = 15 * time.Second

// Server is a nats-server child process with JetStream.
type Server struct {
	bin  string
	dir  string
	port int

	// logPath, when set, receives the server's output too, appended across
	// restarts, so that a failure's report can show what the server said
	// when it recovered its store.
	logPath string

	mu  sync.Mutex
	cmd *exec.Cmd
	out *bytes.Buffer
	log *os.File
}

// Binary returns the nats-server binary to run, or an error that says what
// to install or set.
func Binary() (string, error) {
	if b := os.Getenv("NATS_SERVER_BIN"); b != "" {
		return b, nil
	}
	if b, err := exec.LookPath("nats-server"); err == nil {
		return b, nil
	}
	if _, err := os.Stat("/usr/sbin/nats-server"); err == nil {
		return "/usr/sbin/nats-server", nil
	}
	return "", errors.New("natstest: no nats-server binary: install the nats-server package or set NATS_SERVER_BIN")
}

// Start starts a server that is killed when the test ends; it fails the
// test when the server cannot start.
func Start(tb testing.TB) *Server {
	tb.Helper()
	s, err := StartServer(tb.TempDir())
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(s.Kill)
	return s
}

// StartServer starts a server on a free loopback port whose JetStream store
// is dir, for callers that are not tests (the chaos harness). The caller
// kills it with Kill.
func StartServer(dir string) (*Server, error) {
	return StartServerLogging(dir, "")
}

// StartServerLogging is StartServer with the server's output, of this start
// and every later one, appended to the file logPath as well.
func StartServerLogging(dir, logPath string) (*Server, error) {
	bin, err := Binary()
	if err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, fmt.Errorf("natstest: free port: %w", err)
	}
	s := &Server{bin: bin, dir: dir, port: port, logPath: logPath}
	if err := s.start(); err != nil {
		return nil, err
	}
	return s, nil
}

// StartAgain starts a killed server again on the same port and store
// directory; it does nothing when the server runs.
func (s *Server) StartAgain() error {
	s.mu.Lock()
	running := s.cmd != nil
	s.mu.Unlock()
	if running {
		return nil
	}
	return s.start()
}

// URL is the server's client URL.
func (s *Server) URL() string { return "nats://127.0.0.1:" + strconv.Itoa(s.port) }

// Addr is the server's host:port.
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// Kill kills the server (SIGKILL), as a crash would, and waits for it to
// exit. It is safe to call when the server is not running.
func (s *Server) Kill() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
	s.closeLog()
}

// closeLog closes the log file of the last start, if any; s.mu is held.
func (s *Server) closeLog() {
	if s.log != nil {
		_ = s.log.Close()
		s.log = nil
	}
}

// Restart kills the server and starts it again on the same port and store
// directory: what JetStream had written is there again.
func (s *Server) Restart(tb testing.TB) {
	tb.Helper()
	s.Kill()
	if err := s.start(); err != nil {
		tb.Fatal(err)
	}
}

func (s *Server) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := &bytes.Buffer{}
	cmd := exec.Command(s.bin, "-js", "-a", "127.0.0.1", "-p", strconv.Itoa(s.port), "-sd", s.dir)
	var w io.Writer = out
	if s.logPath != "" {
		f, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
		if err != nil {
			return fmt.Errorf("natstest: open the server's log: %w", err)
		}
		fmt.Fprintf(f, "--- natstest: starting %s at %s\n", s.bin, time.Now().UTC().Format("15:04:05.000"))
		s.log, w = f, io.MultiWriter(out, f)
	}
	cmd.Stdout, cmd.Stderr = w, w
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		s.closeLog()
		return fmt.Errorf("natstest: start %s: %w", s.bin, err)
	}
	s.cmd, s.out = cmd, out
	ctx, cancel := context.WithTimeout(context.Background(), readyTimeout)
	defer cancel()
	var last error
	for ctx.Err() == nil {
		if last = ready(ctx, s.URL()); last == nil {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	s.cmd = nil
	s.closeLog()
	return fmt.Errorf("natstest: server on port %d not ready in %v: %v; its output:\n%s", s.port, readyTimeout, last, out.String())
}

// ready reports whether JetStream answers at url.
func ready(ctx context.Context, url string) error {
	nc, err := nats.Connect(url, nats.Timeout(time.Second), nats.MaxReconnects(0))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	_, err = js.AccountInfo(ctx)
	return err
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
