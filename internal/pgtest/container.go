package pgtest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"time"

	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/wait"
)

const (
	// containerImage is the image of the container step.
	containerImage = "postgres:15-alpine"
	// dockerHealthTimeout bounds the check that a Docker engine answers.
	dockerHealthTimeout = 3 * time.Second
	// containerStartTimeout bounds pulling and starting the container.
	containerStartTimeout = 3 * time.Minute
)

// containerUsed records that this process created containers through
// testcontainers, whose background goroutines [Main] then tolerates.
var containerUsed atomic.Bool

// container is a PostgreSQL container started with testcontainers.
type container struct {
	ctr     testcontainers.Container
	connStr string
}

// stop terminates and removes the container.
func (c *container) stop(ctx context.Context) error {
	if err := c.ctr.Terminate(ctx); err != nil {
		return fmt.Errorf("pgtest: terminate container %s: %w", c.ctr.GetContainerID(), err)
	}
	return nil
}

// dockerHealth reports whether a Docker engine answers, within
// dockerHealthTimeout. testcontainers panics in some setups without an
// engine; such a panic becomes an error.
func dockerHealth(ctx context.Context) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("pgtest: docker engine check panicked: %v", r)
		}
	}()
	ctx, cancel := context.WithTimeout(ctx, dockerHealthTimeout)
	defer cancel()
	// This finds the Docker host and checks that it answers, within ctx;
	// testcontainers remembers the result for the rest of the process.
	cli, err := testcontainers.NewDockerClientWithOpts(ctx)
	if err != nil {
		if os.Getenv("DOCKER_HOST") == "" {
			if _, statErr := os.Stat("/var/run/docker.sock"); statErr != nil {
				return fmt.Errorf("pgtest: no docker engine answers: DOCKER_HOST is not set and /var/run/docker.sock does not exist: %w", err)
			}
		}
		return fmt.Errorf("pgtest: no docker engine answers: %w", err)
	}
	defer cli.Close()
	provider, err := testcontainers.NewDockerProvider()
	if err != nil {
		return fmt.Errorf("pgtest: no docker engine answers: %w", err)
	}
	if err := provider.Health(ctx); err != nil { // closes provider
		return fmt.Errorf("pgtest: no docker engine answers: %w", err)
	}
	return nil
}

// startContainer starts a PostgreSQL container with trust authentication,
// once a Docker engine has answered, and waits until it accepts connections.
func startContainer(ctx context.Context) (c *container, err error) {
	if err := dockerHealth(ctx); err != nil {
		return nil, err
	}
	defer func() {
		if r := recover(); r != nil {
			c, err = nil, fmt.Errorf("pgtest: start %s container with docker panicked: %v", containerImage, r)
		}
	}()
	ctx, cancel := context.WithTimeout(ctx, containerStartTimeout)
	defer cancel()
	containerUsed.Store(true)
	req := testcontainers.GenericContainerRequest{
		ContainerRequest: testcontainers.ContainerRequest{
			Image:        containerImage,
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
			).WithDeadline(containerStartTimeout),
		},
		Started: true,
	}
	ctr, err := testcontainers.GenericContainer(ctx, req)
	if err != nil {
		_ = testcontainers.TerminateContainer(ctr) // no-op when ctr is nil
		return nil, fmt.Errorf("pgtest: start %s container with docker: %w", containerImage, err)
	}
	c = &container{ctr: ctr}
	c.connStr, err = containerConnString(ctx, ctr)
	if err == nil {
		err = ping(ctx, c.connStr)
	}
	if err != nil {
		return nil, errors.Join(
			fmt.Errorf("pgtest: reach %s container %s started with docker: %w", containerImage, ctr.GetContainerID(), err),
			c.stop(context.WithoutCancel(ctx)))
	}
	return c, nil
}

// containerConnString returns the connection string of the server in ctr.
func containerConnString(ctx context.Context, ctr testcontainers.Container) (string, error) {
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
