package rabbitbus_test

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/sagaflow/sagaflow/transport/rabbitbus"
)

// rabbitmqServer is the server start script of Debian's rabbitmq-server
// package, run directly (the /usr/sbin wrapper switches to the rabbitmq
// user).
const rabbitmqServer = "/usr/lib/rabbitmq/bin/rabbitmq-server"

// nodeBootTimeout bounds a throwaway node's start (about 5 s here).
const nodeBootTimeout = 40 * time.Second

// node is a throwaway RabbitMQ node of a test's own: its own name, ports,
// data and logs in a temporary directory, so that it can be stopped,
// killed and restarted without touching the broker other tests share.
type node struct {
	t        testing.TB
	dir      string
	name     string
	port     int
	distPort int
	config   string // rabbitmq.conf lines
	cmd      *exec.Cmd
	exited   chan struct{}
}

// startNode starts a throwaway node with the given rabbitmq.conf lines,
// stopped when the test ends. The test is skipped when the server is not
// installed.
func startNode(t testing.TB, config string) *node {
	t.Helper()
	if _, err := os.Stat(rabbitmqServer); err != nil {
		t.Skipf("no RabbitMQ server at %s (Debian: apt-get install rabbitmq-server); a test of its own node needs it: %v",
			rabbitmqServer, err)
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	n := &node{t: t, dir: t.TempDir(), name: "sf-test-" + hex.EncodeToString(b[:]) + "@localhost",
		port: freePort(t), distPort: freePort(t), config: config}
	if err := os.WriteFile(filepath.Join(n.dir, "enabled_plugins"), []byte("[].\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(n.dir, "rabbitmq.conf"), []byte(config+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.stop(true) })
	if err := n.start(); err != nil {
		t.Fatal(err)
	}
	return n
}

func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func (n *node) url() string { return fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", n.port) }

// start boots the node and waits until it takes AMQP connections.
func (n *node) start() error {
	log, err := os.OpenFile(filepath.Join(n.dir, "server.out"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer log.Close()
	cmd := exec.Command(rabbitmqServer)
	cmd.Dir = n.dir
	cmd.Env = append(os.Environ(),
		"HOME="+n.dir, // its Erlang cookie
		"RABBITMQ_NODENAME="+n.name,
		"RABBITMQ_NODE_IP_ADDRESS=127.0.0.1",
		"RABBITMQ_NODE_PORT="+strconv.Itoa(n.port),
		"RABBITMQ_DIST_PORT="+strconv.Itoa(n.distPort),
		"RABBITMQ_MNESIA_BASE="+filepath.Join(n.dir, "mnesia"),
		"RABBITMQ_LOG_BASE="+filepath.Join(n.dir, "log"),
		"RABBITMQ_ENABLED_PLUGINS_FILE="+filepath.Join(n.dir, "enabled_plugins"),
		"RABBITMQ_CONFIG_FILE="+filepath.Join(n.dir, "rabbitmq.conf"),
		"RABBITMQ_ADVANCED_CONFIG_FILE="+filepath.Join(n.dir, "advanced.config"),
		"RABBITMQ_PID_FILE="+filepath.Join(n.dir, "pid"),
	)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // the script and the Erlang VM, stopped as a group
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", rabbitmqServer, err)
	}
	n.cmd, n.exited = cmd, make(chan struct{})
	go func() { _ = cmd.Wait(); close(n.exited) }()
	deadline := time.Now().Add(nodeBootTimeout)
	for {
		conn, err := rabbitbus.Dial(n.url())()
		if err == nil {
			_ = conn.Close()
			return nil
		}
		select {
		case <-n.exited:
			out, _ := os.ReadFile(filepath.Join(n.dir, "server.out"))
			return fmt.Errorf("throwaway RabbitMQ node %s exited while starting: %s", n.name, out)
		default:
		}
		if time.Now().After(deadline) {
			n.stop(true)
			return fmt.Errorf("throwaway RabbitMQ node %s did not take connections within %v: %w", n.name, nodeBootTimeout, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// stop ends the node: SIGKILL (a crash) when kill, else SIGTERM (a clean
// shutdown), and waits for it.
func (n *node) stop(kill bool) {
	if n.cmd == nil {
		return
	}
	sig := syscall.SIGTERM
	if kill {
		sig = syscall.SIGKILL
	}
	_ = syscall.Kill(-n.cmd.Process.Pid, sig)
	select {
	case <-n.exited:
	case <-time.After(30 * time.Second):
		_ = syscall.Kill(-n.cmd.Process.Pid, syscall.SIGKILL)
		<-n.exited
	}
	n.cmd = nil
}

// restart stops the node, with SIGKILL (a crash) when kill, else with
// SIGTERM (a clean shutdown), and starts it again on the same data.
func (n *node) restart(kill bool) error {
	n.stop(kill)
	return n.start()
}
