package pgtest_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// connect opens a connection that the test closes when it ends.
func connect(t *testing.T, connStr string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, connStr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

func schemaExists(t *testing.T, conn *pgx.Conn, name string) bool {
	t.Helper()
	var n int
	err := conn.QueryRow(t.Context(),
		"select count(*) from information_schema.schemata where schema_name = $1", name).Scan(&n)
	require.NoError(t, err)
	return n == 1
}

func TestConnString(t *testing.T) {
	connStr := pgtest.ConnString(t)
	require.NotEmpty(t, connStr)
	require.Equal(t, connStr, pgtest.ConnString(t), "discovery is cached")

	var one int
	require.NoError(t, connect(t, connStr).QueryRow(t.Context(), "select 1").Scan(&one))
	require.Equal(t, 1, one)
}

func TestNewSchema(t *testing.T) {
	var name string
	// The subtest's cleanups, NewSchema's among them, have run when t.Run
	// returns.
	t.Run("use", func(t *testing.T) {
		pool, n := pgtest.NewSchema(t)
		name = n
		ctx := t.Context()
		require.Regexp(t, `^t_[0-9a-f]{12}$`, n)
		require.EqualValues(t, 12, pool.Config().MaxConns)

		var exists bool
		require.NoError(t, pool.QueryRow(ctx,
			"select exists (select 1 from information_schema.schemata where schema_name = $1)", n).Scan(&exists))
		require.True(t, exists, "schema %s exists during the test", n)

		var tables int
		require.NoError(t, pool.QueryRow(ctx,
			"select count(*) from information_schema.tables where table_schema = $1", n).Scan(&tables))
		require.Zero(t, tables, "a new schema is empty")

		qualified := pgx.Identifier{n, "widgets"}.Sanitize()
		_, err := pool.Exec(ctx, "create table "+qualified+" (id int primary key, name text not null)")
		require.NoError(t, err)
		_, err = pool.Exec(ctx, "insert into "+qualified+" values (1, 'sprocket')")
		require.NoError(t, err)
		var got string
		require.NoError(t, pool.QueryRow(ctx, "select name from "+qualified+" where id = 1").Scan(&got))
		require.Equal(t, "sprocket", got)

		var searchPath string
		require.NoError(t, pool.QueryRow(ctx, "show search_path").Scan(&searchPath))
		require.Equal(t, `"$user", public`, searchPath, "the pool's search_path is left alone")

		_, other := pgtest.NewSchema(t)
		require.NotEqual(t, n, other)
	})
	require.NotEmpty(t, name)

	conn := connect(t, pgtest.ConnString(t))
	require.False(t, schemaExists(t, conn, name), "schema %s is dropped after the test", name)
	var tables int
	require.NoError(t, conn.QueryRow(t.Context(),
		"select count(*) from information_schema.tables where table_schema = $1", name).Scan(&tables))
	require.Zero(t, tables)
}

func TestStartServer(t *testing.T) {
	ctx := t.Context()
	start := time.Now()
	s, err := pgtest.StartServer(ctx)
	require.NoError(t, err)
	t.Logf("throwaway server on port %d started in %v (data dir %s)", s.Port(), time.Since(start).Round(time.Millisecond), s.DataDir())
	t.Cleanup(func() { _ = s.Stop(context.Background()) })

	require.Equal(t, fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.Port()), s.ConnString())
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		require.NoError(t, err)
		fi, err := os.Stat(s.DataDir())
		require.NoError(t, err)
		require.Equal(t, u.Uid, strconv.Itoa(int(fi.Sys().(*syscall.Stat_t).Uid)), "as root, the server runs as the postgres OS user")
	}

	conn, err := pgx.Connect(ctx, s.ConnString())
	require.NoError(t, err)
	var one int
	require.NoError(t, conn.QueryRow(ctx, "select 1").Scan(&one))
	require.Equal(t, 1, one)
	var dataDir string
	require.NoError(t, conn.QueryRow(ctx, "show data_directory").Scan(&dataDir))
	require.Equal(t, s.DataDir(), dataDir)
	_, err = conn.Exec(ctx, "create table crash_probe (id int primary key)")
	require.NoError(t, err)
	_, err = conn.Exec(ctx, "insert into crash_probe values (1), (2), (3)")
	require.NoError(t, err)

	start = time.Now()
	require.NoError(t, s.Kill())
	t.Logf("kill took %v", time.Since(start).Round(time.Millisecond))
	require.NoError(t, s.Kill(), "kill of a stopped server does nothing")
	_ = conn.Close(context.Background())
	_, err = os.Stat(s.DataDir())
	require.NoError(t, err, "kill keeps the data dir")
	dialCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
	_, err = pgx.Connect(dialCtx, s.ConnString())
	cancel()
	require.Error(t, err, "the server is down after kill")

	// While something else holds the port, Restart fails and names the log.
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(s.Port())))
	require.NoError(t, err)
	err = s.Restart(ctx)
	require.NoError(t, l.Close())
	require.Error(t, err)
	require.ErrorContains(t, err, s.LogPath())
	require.ErrorContains(t, err, "could not bind")
	t.Logf("restart on a taken port: %v", err)

	start = time.Now()
	require.NoError(t, s.Restart(ctx))
	t.Logf("restart with crash recovery took %v", time.Since(start).Round(time.Millisecond))
	logText, err := os.ReadFile(s.LogPath())
	require.NoError(t, err)
	require.Contains(t, string(logText), "automatic recovery in progress", "restart after kill runs crash recovery")

	conn, err = pgx.Connect(ctx, s.ConnString())
	require.NoError(t, err)
	var n int
	require.NoError(t, conn.QueryRow(ctx, "select count(*) from crash_probe").Scan(&n))
	require.Equal(t, 3, n, "committed rows survive the crash")
	_ = conn.Close(context.Background())

	require.NoError(t, s.Restart(ctx), "restart of a running server shuts it down and starts it again")
	conn, err = pgx.Connect(ctx, s.ConnString())
	require.NoError(t, err)
	require.NoError(t, conn.QueryRow(ctx, "select count(*) from crash_probe").Scan(&n))
	require.Equal(t, 3, n)
	_ = conn.Close(context.Background())

	require.NoError(t, s.Kill())
	require.NoError(t, s.Stop(ctx), "stop after kill")
	_, err = os.Stat(s.DataDir())
	require.True(t, errors.Is(err, os.ErrNotExist), "stop removes the data dir, got %v", err)
	require.NoError(t, s.Stop(ctx), "stop after stop does nothing")
	require.NoError(t, s.Kill(), "kill after stop does nothing")
	require.ErrorContains(t, s.Restart(ctx), "data directory removed")
}

func TestContainer(t *testing.T) {
	ctx := t.Context()
	if err := pgtest.FindDockerEngine(); err == nil {
		// A Docker engine may answer: the container step must really work.
		connStr, stop, err := pgtest.StartContainer(ctx)
		require.NoError(t, err)
		var one int
		require.NoError(t, connect(t, connStr).QueryRow(ctx, "select 1").Scan(&one))
		require.NoError(t, stop(context.Background()))
		return
	}
	// No Docker engine: the step fails at once, without building the
	// helper, and says why.
	start := time.Now()
	connStr, stop, err := pgtest.StartContainer(ctx)
	elapsed := time.Since(start)
	t.Logf("container step failed in %v: %v", elapsed.Round(time.Millisecond), err)
	require.Error(t, err)
	require.ErrorIs(t, err, pgtest.ErrNoDockerEngine)
	require.Less(t, elapsed, 5*time.Second)
	require.Contains(t, err.Error(), "DOCKER_HOST")
	require.Contains(t, err.Error(), "/var/run/docker.sock")
	require.Empty(t, connStr)
	require.Nil(t, stop)
}

// TestContainerHelper runs the container step's helper, a module of its
// own, against a socket that accepts connections but is no Docker engine:
// the helper is built and run, finds no engine, and the step reports what
// the helper said.
func TestContainerHelper(t *testing.T) {
	if pgtest.FindDockerEngine() == nil {
		t.Skip("a Docker engine may answer here; TestContainer starts a real container through the helper")
	}
	// The root module does not require the helper's modules, so a module
	// cache filled for it alone may lack them.
	module, err := pgtest.HelperModule()
	require.NoError(t, err)
	download := exec.CommandContext(t.Context(), "go", "mod", "download")
	download.Dir = module
	download.Env = append(os.Environ(), "GOWORK=off")
	if out, err := download.CombinedOutput(); err != nil {
		t.Skipf("the container helper's modules are not in the module cache and cannot be downloaded: %v\n%s", err, out)
	}

	sock := filepath.Join(t.TempDir(), "docker.sock")
	l, err := net.Listen("unix", sock)
	require.NoError(t, err)
	accepted := make(chan struct{})
	var once sync.Once
	go func() {
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			once.Do(func() { close(accepted) })
			_ = conn.Close()
		}
	}()
	t.Cleanup(func() { _ = l.Close() })
	// No ~/.testcontainers.properties either, or FindDockerEngine would
	// have said an engine may answer: DOCKER_HOST is the only host.
	t.Setenv("DOCKER_HOST", "unix://"+sock)
	require.NoError(t, pgtest.FindDockerEngine(), "the socket accepts connections")

	start := time.Now()
	connStr, stop, err := pgtest.StartContainer(t.Context())
	t.Logf("container step failed in %v: %v", time.Since(start).Round(time.Millisecond), err)
	require.Error(t, err)
	require.ErrorIs(t, err, pgtest.ErrNoDockerEngine)
	require.Contains(t, err.Error(), "pgcontainer: no docker engine answers", "the helper's own message")
	require.Contains(t, err.Error(), sock)
	require.NotContains(t, err.Error(), "panic")
	require.Empty(t, connStr)
	require.Nil(t, stop)
	select {
	case <-accepted:
	default:
		t.Fatal("the helper never connected to DOCKER_HOST")
	}
}

// fakeHelperEnv makes TestFakeContainerHelper play the container helper in
// a child test binary.
const fakeHelperEnv = "PGTEST_FAKE_CONTAINER_HELPER"

// TestFakeContainerHelper plays the container helper for
// TestContainerHelperProtocol in a child test binary. With
// PGTEST_FAKE_CONTAINER_HELPER=serve it prints a line of noise and
// DSN=$PGTEST_FAKE_DSN, waits for the end of its stdin and then creates
// the file $PGTEST_FAKE_RELEASED; with "no-engine" it exits as the helper
// does when no Docker engine answers.
func TestFakeContainerHelper(t *testing.T) {
	switch os.Getenv(fakeHelperEnv) {
	case "serve":
		fmt.Println("pulling image (noise)")
		fmt.Printf("DSN=%s\n", os.Getenv("PGTEST_FAKE_DSN"))
		_, err := io.Copy(io.Discard, os.Stdin)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(os.Getenv("PGTEST_FAKE_RELEASED"), nil, 0o600))
	case "no-engine":
		fmt.Fprintln(os.Stderr, "pgcontainer: no docker engine answers: fake")
		os.Exit(3)
	default:
		t.Skip("run by TestContainerHelperProtocol in a child process")
	}
}

// TestContainerHelperProtocol checks the harness's side of the container
// helper's protocol against a fake helper: the connection string is read
// from its DSN= line, the container is kept while its stdin is open, stop
// closes stdin and waits for its exit, and its failures are reported.
func TestContainerHelperProtocol(t *testing.T) {
	t.Parallel()
	dsn := pgtest.ConnString(t)
	run := func(t *testing.T, mode string, env ...string) (string, func(context.Context) error, error) {
		t.Helper()
		env = append(append(os.Environ(), fakeHelperEnv+"="+mode), env...)
		return pgtest.RunHelper(t.Context(), os.Args[0], []string{"-test.run=^TestFakeContainerHelper$", "-test.count=1"}, env)
	}

	t.Run("serve", func(t *testing.T) {
		t.Parallel()
		released := filepath.Join(t.TempDir(), "released")
		connStr, stop, err := run(t, "serve", "PGTEST_FAKE_DSN="+dsn, "PGTEST_FAKE_RELEASED="+released)
		require.NoError(t, err)
		require.Equal(t, dsn, connStr)
		_, err = os.Stat(released)
		require.ErrorIs(t, err, os.ErrNotExist, "the helper keeps its container while its stdin is open")
		require.NoError(t, stop(t.Context()))
		_, err = os.Stat(released)
		require.NoError(t, err, "stop closed the helper's stdin and waited for it to exit")
		require.NoError(t, stop(t.Context()), "a second stop does nothing")
	})

	t.Run("no engine", func(t *testing.T) {
		t.Parallel()
		connStr, stop, err := run(t, "no-engine")
		require.ErrorIs(t, err, pgtest.ErrNoDockerEngine)
		require.ErrorContains(t, err, "exit status 3")
		require.ErrorContains(t, err, "pgcontainer: no docker engine answers: fake", "the helper's own message")
		require.Empty(t, connStr)
		require.Nil(t, stop)
	})

	t.Run("exit without a connection string", func(t *testing.T) {
		t.Parallel()
		_, stop, err := run(t, "")
		require.ErrorContains(t, err, "exited without printing a connection string")
		require.NotErrorIs(t, err, pgtest.ErrNoDockerEngine)
		require.Nil(t, stop)
	})
}

func TestParseMode(t *testing.T) {
	for in, want := range map[string]string{
		"":             "auto",
		"auto":         "auto",
		"url":          "url",
		"local":        "local",
		" Throwaway\n": "throwaway",
		"CONTAINER":    "container",
	} {
		got, err := pgtest.ParseMode(in)
		require.NoError(t, err, "%q", in)
		require.Equal(t, want, got, "%q", in)
	}

	_, err := pgtest.ParseMode("docker")
	require.Error(t, err)
	msg := err.Error()
	assert.Contains(t, msg, `SAGAFLOW_PGTEST="docker"`)
	for _, allowed := range []string{"auto", "url", "local", "throwaway", "container"} {
		assert.Contains(t, msg, allowed)
	}
}

func TestDiscover(t *testing.T) {
	var ran []string
	fail := func(name string) func(context.Context) (string, error) {
		return func(context.Context) (string, error) {
			ran = append(ran, name)
			return "", fmt.Errorf("%s is broken", name)
		}
	}
	succeed := func(name string) func(context.Context) (string, error) {
		return func(context.Context) (string, error) {
			ran = append(ran, name)
			return "postgres://" + name, nil
		}
	}
	steps := func(url, local, throwaway, container func(context.Context) (string, error)) []pgtest.Step {
		return []pgtest.Step{
			{Mode: "url", Hint: "set TEST_DATABASE_URL", Run: url},
			{Mode: "local", Hint: "run PostgreSQL on 127.0.0.1:5432", Run: local},
			{Mode: "throwaway", Hint: "install PostgreSQL server binaries", Run: throwaway},
			{Mode: "container", Hint: "run a Docker engine", Run: container},
		}
	}
	ctx := t.Context()

	t.Run("auto takes the first that works", func(t *testing.T) {
		ran = nil
		got, err := pgtest.Discover(ctx, "auto", steps(fail("url"), fail("local"), succeed("throwaway"), succeed("container")))
		require.NoError(t, err)
		require.Equal(t, "postgres://throwaway", got)
		require.Equal(t, []string{"url", "local", "throwaway"}, ran)
	})

	t.Run("auto explains every step when none works", func(t *testing.T) {
		ran = nil
		_, err := pgtest.Discover(ctx, "auto", steps(fail("url"), fail("local"), fail("throwaway"), fail("container")))
		require.Error(t, err)
		require.Equal(t, []string{"url", "local", "throwaway", "container"}, ran)
		msg := err.Error()
		for _, want := range []string{
			"set TEST_DATABASE_URL", "url is broken",
			"run PostgreSQL on 127.0.0.1:5432", "local is broken",
			"install PostgreSQL server binaries", "throwaway is broken",
			"run a Docker engine", "container is broken",
		} {
			assert.Contains(t, msg, want)
		}
		t.Logf("message:\n%s", msg)
	})

	t.Run("forced mode runs only its step", func(t *testing.T) {
		ran = nil
		_, err := pgtest.Discover(ctx, "container", steps(succeed("url"), succeed("local"), succeed("throwaway"), fail("container")))
		require.Error(t, err)
		require.Equal(t, []string{"container"}, ran)
		assert.Contains(t, err.Error(), "SAGAFLOW_PGTEST=container")
		assert.Contains(t, err.Error(), "run a Docker engine")
		assert.NotContains(t, err.Error(), "TEST_DATABASE_URL")
	})

	t.Run("a fatal step stops discovery", func(t *testing.T) {
		ran = nil
		fatal := func(context.Context) (string, error) {
			ran = append(ran, "url")
			return "", pgtest.Fatal(errors.New("pgtest: parse TEST_DATABASE_URL: bad"))
		}
		_, err := pgtest.Discover(ctx, "auto", steps(fatal, succeed("local"), succeed("throwaway"), succeed("container")))
		require.EqualError(t, err, "pgtest: parse TEST_DATABASE_URL: bad")
		require.Equal(t, []string{"url"}, ran)
	})
}

// helperEnv turns TestHelperProcess on in a child test binary.
const helperEnv = "PGTEST_HELPER_PROCESS"

// TestHelperProcess is run by TestForcedModes in a child test binary, where
// discovery runs afresh under a forced SAGAFLOW_PGTEST.
func TestHelperProcess(t *testing.T) {
	if os.Getenv(helperEnv) != "1" {
		t.Skip("run by TestForcedModes in a child process")
	}
	connStr := pgtest.ConnString(t)
	var one int
	require.NoError(t, connect(t, connStr).QueryRow(t.Context(), "select 1").Scan(&one))
	if s := pgtest.OwnedServer(); s != nil {
		fmt.Printf("PGTEST_DATADIR=%s\n", s.DataDir())
	}
	fmt.Printf("PGTEST_CONNSTRING=%s\n", connStr)
}

// runHelper runs TestHelperProcess in a child test binary with env added
// (a value of "" removes the variable) and returns its output and error.
func runHelper(t *testing.T, env map[string]string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1", "-test.v")
	for _, kv := range os.Environ() {
		if _, ok := env[strings.SplitN(kv, "=", 2)[0]]; !ok {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	for k, v := range env {
		if v != "" {
			cmd.Env = append(cmd.Env, k+"="+v)
		}
	}
	cmd.Env = append(cmd.Env, helperEnv+"=1")
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := cmd.Run()
	return out.String(), err
}

func TestForcedModes(t *testing.T) {
	noURL := map[string]string{"TEST_DATABASE_URL": "", "DATABASE_URL": ""}
	with := func(m map[string]string, k, v string) map[string]string {
		c := map[string]string{k: v}
		for mk, mv := range m {
			c[mk] = mv
		}
		return c
	}

	t.Run("throwaway", func(t *testing.T) {
		t.Parallel()
		out, err := runHelper(t, with(noURL, "SAGAFLOW_PGTEST", "throwaway"))
		require.NoError(t, err, out)
		m := regexp.MustCompile(`PGTEST_DATADIR=(\S+)`).FindStringSubmatch(out)
		require.NotNil(t, m, out)
		_, err = os.Stat(m[1])
		require.True(t, errors.Is(err, os.ErrNotExist), "Main stops the throwaway server and removes %s: %v", m[1], err)
		require.NotContains(t, out, "PGTEST_CONNSTRING=postgres://postgres@127.0.0.1:5432/")
	})

	t.Run("url", func(t *testing.T) {
		t.Parallel()
		connStr := pgtest.ConnString(t)
		out, err := runHelper(t, map[string]string{"SAGAFLOW_PGTEST": "url", "TEST_DATABASE_URL": connStr})
		require.NoError(t, err, out)
		require.Contains(t, out, "PGTEST_CONNSTRING="+connStr)
	})

	t.Run("url unset", func(t *testing.T) {
		t.Parallel()
		out, err := runHelper(t, with(noURL, "SAGAFLOW_PGTEST", "url"))
		require.Error(t, err, out)
		require.Contains(t, out, "SAGAFLOW_PGTEST=url")
		require.Contains(t, out, "TEST_DATABASE_URL and DATABASE_URL are not set")
	})

	t.Run("container", func(t *testing.T) {
		t.Parallel()
		if pgtest.FindDockerEngine() == nil {
			t.Skip("a Docker engine may answer; TestContainer covers the container step")
		}
		start := time.Now()
		out, err := runHelper(t, with(noURL, "SAGAFLOW_PGTEST", "container"))
		require.Error(t, err, out)
		require.Contains(t, out, "SAGAFLOW_PGTEST=container")
		require.Contains(t, out, "run a Docker engine")
		require.NotContains(t, out, "panic")
		t.Logf("child failed as expected in %v:\n%s", time.Since(start).Round(time.Millisecond), out)
	})

	t.Run("invalid", func(t *testing.T) {
		t.Parallel()
		out, err := runHelper(t, map[string]string{"SAGAFLOW_PGTEST": "bogus"})
		require.Error(t, err, out)
		require.Contains(t, out, `SAGAFLOW_PGTEST="bogus" is not valid`)
	})
}
