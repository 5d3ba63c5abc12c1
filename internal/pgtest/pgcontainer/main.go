// Command pgcontainer is the container fallback of the sagaflow test harness
// (internal/pgtest): it starts a PostgreSQL container with testcontainers-go,
// writes its connection string to stdout as one line
//
//	DSN=postgres://postgres@127.0.0.1:32771/postgres?sslmode=disable
//
// and keeps the container until its stdin is closed or it gets SIGINT or
// SIGTERM; then it removes the container and exits 0. Everything else it
// (and testcontainers) prints goes to stderr.
//
// It is a module of its own so that the sagaflow module, and so every
// module that depends on it, does not require testcontainers, Docker's or
// moby's modules. pgtest builds and runs it only when no earlier way of
// finding a server worked.
//
// Exit status 3 means that no Docker engine answers; 1 is any other failure,
// with the reason on stderr.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/wait"
)

const (
	// image is the image of the container.
	image = "postgres:15-alpine"
	// healthTimeout bounds the check that a Docker engine answers.
	healthTimeout = 3 * time.Second
	// startTimeout bounds pulling and starting the container.
	startTimeout = 3 * time.Minute
	// terminateTimeout bounds removing the container.
	terminateTimeout = time.Minute
)

// Exit statuses.
const (
	exitFailure  = 1
	exitNoEngine = 3
)

// errNoEngine marks a failure because no Docker engine answers.
var errNoEngine = errors.New("no docker engine answers")

func main() {
	// The connection string is the only thing written to the real stdout;
	// anything that writes to os.Stdout from here on goes to stderr.
	out := os.Stdout
	os.Stdout = os.Stderr

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, out, os.Stdin); err != nil {
		fmt.Fprintf(os.Stderr, "pgcontainer: %v\n", err)
		if errors.Is(err, errNoEngine) {
			os.Exit(exitNoEngine)
		}
		os.Exit(exitFailure)
	}
}

// run starts the container, writes its connection string to out, waits
// until in reaches its end or ctx is done, and removes the container.
func run(ctx context.Context, out io.Writer, in io.Reader) error {
	if err := dockerHealth(ctx); err != nil {
		return err
	}
	ctr, connStr, err := start(ctx)
	if err != nil {
		return err
	}
	released := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, in)
		close(released)
	}()
	_, err = fmt.Fprintf(out, "DSN=%s\n", connStr)
	if err == nil {
		select {
		case <-released:
		case <-ctx.Done():
		}
	}
	tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), terminateTimeout)
	defer cancel()
	if terr := ctr.Terminate(tctx); terr != nil {
		err = errors.Join(err, fmt.Errorf("terminate container %s: %w", ctr.GetContainerID(), terr))
	}
	return err
}

// dockerHealth reports whether a Docker engine answers, within
// healthTimeout. testcontainers panics in some setups without an engine;
// such a panic becomes an error.
func dockerHealth(ctx context.Context) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: the engine check panicked: %v", errNoEngine, r)
		}
	}()
	ctx, cancel := context.WithTimeout(ctx, healthTimeout)
	defer cancel()
	// This finds the Docker host and checks that it answers, within ctx;
	// testcontainers remembers the result for the rest of the process.
	cli, err := testcontainers.NewDockerClientWithOpts(ctx)
	if err != nil {
		return fmt.Errorf("%w: %w", errNoEngine, err)
	}
	defer cli.Close()
	provider, err := testcontainers.NewDockerProvider()
	if err != nil {
		return fmt.Errorf("%w: %w", errNoEngine, err)
	}
	if err := provider.Health(ctx); err != nil { // closes provider
		return fmt.Errorf("%w: %w", errNoEngine, err)
	}
	return nil
}

// start starts a PostgreSQL container with trust authentication and waits
// until it accepts connections.
func start(ctx context.Context) (ctr testcontainers.Container, connStr string, err error) {
	defer func() {
		if r := recover(); r != nil {
			ctr, connStr, err = nil, "", fmt.Errorf("start %s container with docker panicked: %v", image, r)
		}
	}()
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	req := testcontainers.GenericContainerRequest{
		ContainerRequest: testcontainers.ContainerRequest{
			Image:        image,
			ExposedPorts: []string{"5432/tcp"},
			Env: map[string]string{
				"POSTGRES_HOST_AUTH_METHOD": "trust",
			},
			Cmd: []string{"postgres", "-c", "fsync=off", "-c", "max_connections=200"},
			// The entrypoint runs a temporary server for initialisation
			// first, so the real one is ready at the second message.
			WaitingFor: wait.ForAll(
				wait.ForLog("database system is ready to accept connections").WithOccurrence(2),
				wait.ForListeningPort("5432/tcp"),
			).WithDeadline(startTimeout),
		},
		Started: true,
	}
	ctr, err = testcontainers.GenericContainer(ctx, req)
	if err != nil {
		_ = testcontainers.TerminateContainer(ctr) // no-op when ctr is nil
		return nil, "", fmt.Errorf("start %s container with docker: %w", image, err)
	}
	connStr, err = connString(ctx, ctr)
	if err != nil {
		tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), terminateTimeout)
		defer cancel()
		return nil, "", errors.Join(
			fmt.Errorf("address of %s container %s: %w", image, ctr.GetContainerID(), err),
			ctr.Terminate(tctx))
	}
	return ctr, connStr, nil
}

// connString returns the connection string of the server in ctr.
func connString(ctx context.Context, ctr testcontainers.Container) (string, error) {
	host, err := ctr.Host(ctx)
	if err != nil {
		return "", err
	}
	port, err := ctr.MappedPort(ctx, "5432/tcp")
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable", net.JoinHostPort(host, port.Port())), nil
}
