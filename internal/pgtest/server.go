package pgtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

const (
	// readyTimeout bounds how long a starting server may take to accept
	// connections (crash recovery included).
	readyTimeout = 30 * time.Second
	// killTimeout bounds how long Kill waits for an immediate shutdown
	// before it kills the postmaster outright.
	killTimeout = 30 * time.Second
	// startAttempts is how many ports StartServer tries when the one it
	// picked was taken before the server could bind it.
	startAttempts = 5
	// templateMarker is written into a template data directory once initdb
	// has finished; a directory without it is a leftover and is rebuilt.
	templateMarker = "sagaflow-pgtest-template"
	// ownerFile holds the PID of the process that owns a run directory, so
	// that directories left behind by dead processes can be removed.
	ownerFile = "owner.pid"
)

// errPortInUse marks a start that failed because the port was taken.
var errPortInUse = errors.New("port already in use")

// Server is a throwaway PostgreSQL server run as a child process of the test
// binary, with its own data directory copied from a template. It listens on
// 127.0.0.1 only and accepts the superuser postgres without a password.
//
// Stop, Kill and Restart may be called in any order and from any goroutine;
// once Stop has removed the data directory, Restart reports an error and
// Stop and Kill do nothing.
type Server struct {
	bins    binaries
	as      runAs
	runDir  string
	dataDir string
	logPath string
	port    int

	mu      sync.Mutex
	proc    *process // nil when this Server has no postmaster running
	removed bool     // Stop has removed runDir
}

// process is one run of the postmaster.
type process struct {
	cmd  *exec.Cmd
	done chan struct{} // closed once the postmaster has exited
	err  error         // result of cmd.Wait, valid once done is closed
}

// StartServer starts a new throwaway PostgreSQL server from the PostgreSQL
// server binaries on the machine (pg_config --bindir, else the highest
// version under /usr/lib/postgresql/*/bin, else PATH). It always starts a
// new server, independent of the one [ConnString] may have found.
//
// The first call on a machine runs initdb into a template data directory
// cached under os.TempDir(); every server copies that template. The server
// runs as the "postgres" OS user when the caller is root, listens on a free
// port of 127.0.0.1, runs with fsync off, and dies with the test process.
// StartServer returns once the server accepts connections; ctx bounds the
// start only, not the server's life. The caller must call [Server.Stop];
// [Main] does not know about servers started this way.
func StartServer(ctx context.Context) (*Server, error) {
	bins, err := findBinariesOnce()
	if err != nil {
		return nil, err
	}
	as, err := serverUser()
	if err != nil {
		return nil, err
	}
	base, err := baseDir()
	if err != nil {
		return nil, err
	}
	removeStaleRuns(base)

	tmpl, err := ensureTemplate(ctx, bins, as, base)
	if err != nil {
		return nil, err
	}

	runDir, err := os.MkdirTemp(base, "run-")
	if err != nil {
		return nil, fmt.Errorf("pgtest: create run directory in %s: %w", base, err)
	}
	err = os.WriteFile(filepath.Join(runDir, ownerFile), []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644)
	if err == nil {
		err = as.chown(runDir)
	}
	if err != nil {
		_ = os.RemoveAll(runDir)
		return nil, fmt.Errorf("pgtest: prepare run directory %s: %w", runDir, err)
	}
	s := &Server{
		bins:    bins,
		as:      as,
		runDir:  runDir,
		dataDir: filepath.Join(runDir, "data"),
		logPath: filepath.Join(runDir, "postgres.log"),
	}
	if err := copyTree(tmpl, s.dataDir, as); err != nil {
		_ = os.RemoveAll(runDir)
		return nil, fmt.Errorf("pgtest: copy template %s to %s: %w", tmpl, s.dataDir, err)
	}

	for attempt := 1; ; attempt++ {
		s.port, err = pickPort()
		if err != nil {
			break
		}
		err = s.start(ctx)
		if err == nil {
			return s, nil
		}
		if !errors.Is(err, errPortInUse) || attempt == startAttempts || ctx.Err() != nil {
			break
		}
	}
	// Keep the log, which the error names; the rest is removed now and the
	// run directory itself by a later StartServer once this process is gone.
	_ = os.RemoveAll(s.dataDir)
	return nil, err
}

// ConnString returns the server's connection string:
// postgres://postgres@127.0.0.1:PORT/postgres?sslmode=disable.
func (s *Server) ConnString() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.port)
}

// Port returns the TCP port the server listens on, on 127.0.0.1. It stays
// the same across [Server.Restart].
func (s *Server) Port() int { return s.port }

// DataDir returns the server's data directory (PGDATA).
func (s *Server) DataDir() string { return s.dataDir }

// LogPath returns the file that receives the server's output, across
// restarts. It is removed by [Server.Stop].
func (s *Server) LogPath() string { return s.logPath }

// Stop shuts the server down the fast way (SIGINT: active transactions are
// rolled back), waits for it to exit, and removes its data directory and
// log. If ctx ends first, Stop escalates to an immediate shutdown and then
// kills the server. Stop after Stop does nothing.
func (s *Server) Stop(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.removed {
		return nil
	}
	stopErr := s.stopProcess(ctx, syscall.SIGINT)
	s.removed = true
	var rmErr error
	if err := os.RemoveAll(s.runDir); err != nil {
		rmErr = fmt.Errorf("pgtest: remove data directory of server on port %d: %w", s.port, err)
	}
	return errors.Join(stopErr, rmErr)
}

// Kill stops the server immediately, like pg_ctl stop -m immediate: it sends
// SIGQUIT to the postmaster, which ends every backend without a checkpoint,
// and waits for it to exit. The data directory is kept, so that
// [Server.Restart] runs crash recovery. Kill on a server that is not running
// does nothing.
func (s *Server) Kill() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), killTimeout)
	defer cancel()
	return s.stopProcess(ctx, syscall.SIGQUIT)
}

// Restart starts the server again on the same port and data directory, after
// [Server.Kill] or after the server died, and waits until it accepts
// connections (crash recovery runs first when it was not shut down cleanly).
// On a running server Restart first shuts it down the fast way. Restart after
// [Server.Stop] is an error, since the data directory is gone.
func (s *Server) Restart(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.removed {
		return fmt.Errorf("pgtest: restart server on port %d: server was stopped and its data directory removed", s.port)
	}
	if err := s.stopProcess(ctx, syscall.SIGINT); err != nil {
		return err
	}
	return s.start(ctx)
}

// start runs the postmaster and waits until it accepts connections. The
// caller holds s.mu or is the only one with access to s.
func (s *Server) start(ctx context.Context) error {
	logf, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("pgtest: start server on port %d: open log: %w", s.port, err)
	}
	var offset int64
	if fi, err := logf.Stat(); err == nil {
		offset = fi.Size()
	}
	fmt.Fprintf(logf, "---- pgtest: starting postgres on port %d at %s\n", s.port, time.Now().Format(time.RFC3339Nano))

	args := []string{
		"-D", s.dataDir,
		"-p", strconv.Itoa(s.port),
		"-c", "listen_addresses=127.0.0.1",
		"-c", "fsync=off",
		"-c", "max_connections=200",
	}
	// A Unix socket path is limited to about 100 bytes; without room for
	// one, the server listens on TCP only.
	if len(s.runDir)+len("/.s.PGSQL.65535.lock") < 100 {
		args = append(args, "-k", s.runDir)
	} else {
		args = append(args, "-c", "unix_socket_directories=")
	}
	cmd := exec.Command(filepath.Join(s.bins.dir, "postgres"), args...)
	cmd.Dir = s.runDir
	cmd.Env = childEnv()
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.SysProcAttr = sysProcAttr(s.as.cred)
	err = cmd.Start()
	_ = logf.Close() // the child has its own descriptor
	if err != nil {
		return fmt.Errorf("pgtest: start server on port %d: %w (server log: %s)", s.port, err, s.logPath)
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	s.proc = p

	if err := s.waitReady(ctx, p); err != nil {
		// Leave no half-started server behind.
		killCtx, cancel := context.WithTimeout(context.Background(), killTimeout)
		_ = s.stopProcess(killCtx, syscall.SIGQUIT)
		cancel()
		logText := readFrom(s.logPath, offset)
		if strings.Contains(logText, "could not bind") || strings.Contains(logText, "Address already in use") {
			err = fmt.Errorf("%w: %w", errPortInUse, err)
		}
		return fmt.Errorf("pgtest: start server on port %d: %w (server log: %s)%s", s.port, err, s.logPath, indentTail(logText, 20))
	}
	return nil
}

// waitReady polls until the server accepts a connection, the postmaster
// exits, or readyTimeout (or ctx) runs out.
func (s *Server) waitReady(ctx context.Context, p *process) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	cfg, err := pgx.ParseConfig(s.ConnString())
	if err != nil {
		return err
	}
	// A connection attempt must not outlive the postmaster: whatever else
	// holds the port when it fails to bind could accept and never answer.
	attemptsCtx, cancelAttempts := context.WithCancel(ctx)
	defer cancelAttempts()
	go func() {
		select {
		case <-p.done:
			cancelAttempts()
		case <-attemptsCtx.Done():
		}
	}()
	var lastErr error
	for {
		attemptCtx, cancelAttempt := context.WithTimeout(attemptsCtx, 5*time.Second)
		conn, err := pgx.ConnectConfig(attemptCtx, cfg)
		if err == nil {
			err = conn.Ping(attemptCtx)
			_ = conn.Close(context.Background())
		}
		cancelAttempt()
		if err == nil {
			return nil
		}
		lastErr = err

		select {
		case <-p.done:
			return fmt.Errorf("postgres exited before accepting connections: %v", p.err)
		default:
		}
		timer := time.NewTimer(25 * time.Millisecond)
		select {
		case <-p.done:
			timer.Stop()
			return fmt.Errorf("postgres exited before accepting connections: %v", p.err)
		case <-ctx.Done():
			timer.Stop()
			return fmt.Errorf("not accepting connections: %w (last attempt: %v)", ctx.Err(), lastErr)
		case <-timer.C:
		}
	}
}

// stopProcess sends sig to the postmaster, if one is running, and waits for
// it to exit. When ctx ends first it escalates to SIGQUIT (immediate
// shutdown), then SIGKILL. The caller holds s.mu or is the only one with
// access to s.
func (s *Server) stopProcess(ctx context.Context, sig syscall.Signal) error {
	p := s.proc
	if p == nil {
		return nil
	}
	s.proc = nil
	select {
	case <-p.done:
		return nil // it had exited on its own
	default:
	}
	if err := p.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		_ = p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("pgtest: signal server on port %d with %v: %w", s.port, sig, err)
	}
	select {
	case <-p.done:
		return nil
	case <-ctx.Done():
	}
	if sig != syscall.SIGQUIT {
		_ = p.cmd.Process.Signal(syscall.SIGQUIT)
		timer := time.NewTimer(10 * time.Second)
		select {
		case <-p.done:
			timer.Stop()
			return fmt.Errorf("pgtest: stop server on port %d with %v: %w; stopped it immediately instead", s.port, sig, ctx.Err())
		case <-timer.C:
		}
	}
	_ = p.cmd.Process.Kill()
	<-p.done
	return fmt.Errorf("pgtest: stop server on port %d with %v: %w; killed it", s.port, sig, ctx.Err())
}

// binaries is a directory of PostgreSQL server programs.
type binaries struct {
	dir   string // holds initdb and postgres
	major string // major version, such as "15" (or "9.6")
}

// findBinariesOnce finds the server binaries once per process.
var findBinariesOnce = sync.OnceValues(findBinaries)

// findBinaries looks for initdb and postgres in pg_config --bindir, then in
// the highest version under /usr/lib/postgresql/*/bin, then on PATH.
func findBinaries() (binaries, error) {
	var dirs, reasons []string
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "pg_config", "--bindir").Output(); err != nil {
		reasons = append(reasons, fmt.Sprintf("pg_config --bindir: %v", err))
	} else {
		dirs = append(dirs, strings.TrimSpace(string(out)))
	}
	versioned, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(versioned, func(a, b string) int {
		return compareVersions(filepath.Base(filepath.Dir(b)), filepath.Base(filepath.Dir(a)))
	})
	if len(versioned) == 0 {
		reasons = append(reasons, "no /usr/lib/postgresql/*/bin")
	}
	dirs = append(dirs, versioned...)
	if p, err := exec.LookPath("postgres"); err == nil {
		dirs = append(dirs, filepath.Dir(p))
	} else {
		reasons = append(reasons, "postgres is not on PATH")
	}

	seen := map[string]bool{}
	for _, dir := range dirs {
		if seen[dir] {
			continue
		}
		seen[dir] = true
		if !isExecutable(filepath.Join(dir, "postgres")) || !isExecutable(filepath.Join(dir, "initdb")) {
			reasons = append(reasons, dir+" has no postgres and initdb")
			continue
		}
		major, err := serverMajor(ctx, dir)
		if err != nil {
			reasons = append(reasons, err.Error())
			continue
		}
		return binaries{dir: dir, major: major}, nil
	}
	return binaries{}, fmt.Errorf("pgtest: find postgresql server binaries: %s", strings.Join(reasons, "; "))
}

var versionRE = regexp.MustCompile(`\(PostgreSQL\) (\d+)(?:\.(\d+))?`)

// serverMajor returns the major version of dir/postgres.
func serverMajor(ctx context.Context, dir string) (string, error) {
	bin := filepath.Join(dir, "postgres")
	out, err := exec.CommandContext(ctx, bin, "--version").Output()
	if err != nil {
		return "", fmt.Errorf("%s --version: %w", bin, err)
	}
	m := versionRE.FindStringSubmatch(string(out))
	if m == nil {
		return "", fmt.Errorf("%s --version: unrecognised output %q", bin, strings.TrimSpace(string(out)))
	}
	if n, _ := strconv.Atoi(m[1]); n < 10 && m[2] != "" {
		return m[1] + "." + m[2], nil // before 10 the major version had two parts
	}
	return m[1], nil
}

// compareVersions compares dotted version strings such as "9.6" and "15"
// numerically.
func compareVersions(a, b string) int {
	pa, pb := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(pa) || i < len(pb); i++ {
		var x, y int
		if i < len(pa) {
			x, _ = strconv.Atoi(pa[i])
		}
		if i < len(pb) {
			y, _ = strconv.Atoi(pb[i])
		}
		if x != y {
			return x - y
		}
	}
	return 0
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

// runAs is the OS user that runs initdb and postgres.
type runAs struct {
	cred     *syscall.Credential // nil: the current user
	uid, gid int
}

// serverUser returns the current user, or the "postgres" OS user when the
// current user is root, which PostgreSQL refuses to run as.
func serverUser() (runAs, error) {
	if os.Geteuid() != 0 {
		return runAs{}, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return runAs{}, fmt.Errorf("pgtest: look up OS user postgres to run the server as, since PostgreSQL refuses to run as root: %w", err)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return runAs{}, fmt.Errorf("pgtest: parse uid %q of OS user postgres: %w", u.Uid, err)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return runAs{}, fmt.Errorf("pgtest: parse gid %q of OS user postgres: %w", u.Gid, err)
	}
	return runAs{
		cred: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)},
		uid:  int(uid),
		gid:  int(gid),
	}, nil
}

// chown gives path to the server user, when that is not the current user.
func (r runAs) chown(path string) error {
	if r.cred == nil {
		return nil
	}
	return os.Lchown(path, r.uid, r.gid)
}

// baseDir returns the directory, private to the current user, that holds
// templates and run directories.
func baseDir() (string, error) {
	dir := filepath.Join(os.TempDir(), fmt.Sprintf("sagaflow-pgtest-%d", os.Geteuid()))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("pgtest: create %s: %w", dir, err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return "", fmt.Errorf("pgtest: stat %s: %w", dir, err)
	}
	if !fi.IsDir() {
		return "", fmt.Errorf("pgtest: %s is not a directory", dir)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Geteuid() {
		return "", fmt.Errorf("pgtest: %s is owned by uid %d, not by the current user", dir, st.Uid)
	}
	// The server user, when it is not us, must be able to reach its
	// directories, whatever the umask.
	if fi.Mode().Perm() != 0o755 {
		if err := os.Chmod(dir, 0o755); err != nil {
			return "", fmt.Errorf("pgtest: chmod %s: %w", dir, err)
		}
	}
	return dir, nil
}

// ensureTemplate returns the template data directory for bins, running
// initdb to create it if needed. Processes serialise on a file lock; the
// template is built in a temporary directory and renamed into place.
func ensureTemplate(ctx context.Context, bins binaries, as runAs, base string) (string, error) {
	name := "template-" + bins.major
	tmpl := filepath.Join(base, name)
	if templateReady(tmpl) {
		return tmpl, nil
	}
	unlock, err := lockFile(ctx, tmpl+".lock")
	if err != nil {
		return "", fmt.Errorf("pgtest: lock template %s: %w", tmpl, err)
	}
	defer unlock()
	if templateReady(tmpl) {
		return tmpl, nil // another process built it meanwhile
	}
	// Under the lock nobody else is building: what is there is left over
	// from a process that died while building.
	if err := os.RemoveAll(tmpl); err != nil {
		return "", fmt.Errorf("pgtest: remove incomplete template %s: %w", tmpl, err)
	}
	if leftovers, err := filepath.Glob(tmpl + ".build-*"); err == nil {
		for _, dir := range leftovers {
			_ = os.RemoveAll(dir)
		}
	}

	build, err := os.MkdirTemp(base, name+".build-")
	if err != nil {
		return "", fmt.Errorf("pgtest: create template build directory: %w", err)
	}
	defer os.RemoveAll(build) // nothing left to remove after the rename
	if err := as.chown(build); err != nil {
		return "", fmt.Errorf("pgtest: chown %s: %w", build, err)
	}

	logPath := tmpl + ".initdb.log"
	logf, err := os.Create(logPath)
	if err != nil {
		return "", fmt.Errorf("pgtest: create initdb log: %w", err)
	}
	cmd := exec.CommandContext(ctx, filepath.Join(bins.dir, "initdb"),
		"-D", build,
		"-U", "postgres",
		"-A", "trust",
		"-E", "UTF8",
		"--locale=C",
		"--no-sync",
	)
	cmd.Dir = base
	cmd.Env = childEnv()
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.SysProcAttr = sysProcAttr(as.cred)
	err = cmd.Run()
	_ = logf.Close()
	if err != nil {
		return "", fmt.Errorf("pgtest: initdb template %s: %w (initdb log: %s)%s",
			tmpl, err, logPath, indentTail(readFrom(logPath, 0), 20))
	}
	if err := os.WriteFile(filepath.Join(build, templateMarker), []byte(bins.dir+"\n"), 0o644); err != nil {
		return "", fmt.Errorf("pgtest: mark template %s: %w", build, err)
	}
	if err := os.Rename(build, tmpl); err != nil {
		return "", fmt.Errorf("pgtest: rename %s to %s: %w", build, tmpl, err)
	}
	return tmpl, nil
}

// templateReady reports whether dir holds a complete template.
func templateReady(dir string) bool {
	for _, name := range []string{templateMarker, "PG_VERSION", filepath.Join("global", "pg_control")} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			return false
		}
	}
	return true
}

// lockFile takes an exclusive flock on path, polling until ctx ends.
func lockFile(ctx context.Context, path string) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() {
				_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
				_ = f.Close()
			}, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			_ = f.Close()
			return nil, err
		}
		timer := time.NewTimer(50 * time.Millisecond)
		select {
		case <-ctx.Done():
			timer.Stop()
			_ = f.Close()
			return nil, ctx.Err()
		case <-timer.C:
		}
	}
}

// copyTree copies the directory src to dst, which must not exist, keeping
// permissions and giving everything to the server user.
func copyTree(src, dst string, as runAs) error {
	return filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		if rel == templateMarker {
			return nil
		}
		target := filepath.Join(dst, rel)
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			if err := os.Mkdir(target, info.Mode().Perm()); err != nil {
				return err
			}
			if err := os.Chmod(target, info.Mode().Perm()); err != nil { // undo the umask
				return err
			}
		case d.Type()&fs.ModeSymlink != 0:
			link, err := os.Readlink(path)
			if err != nil {
				return err
			}
			if err := os.Symlink(link, target); err != nil {
				return err
			}
		case d.Type().IsRegular():
			if err := copyFile(path, target, info.Mode().Perm()); err != nil {
				return err
			}
		default:
			return fmt.Errorf("%s: unexpected file type %v", path, d.Type())
		}
		return as.chown(target)
	})
}

func copyFile(src, dst string, perm fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		_ = out.Close()
		return err
	}
	if err := out.Chmod(perm); err != nil {
		_ = out.Close()
		return err
	}
	return out.Close()
}

// removeStaleRuns removes run directories whose owning process is gone (its
// server died with it, through the parent-death signal).
func removeStaleRuns(base string) {
	entries, err := os.ReadDir(base)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), "run-") {
			continue
		}
		dir := filepath.Join(base, e.Name())
		b, err := os.ReadFile(filepath.Join(dir, ownerFile))
		if err != nil {
			// The owner may be about to write the file; only an old
			// directory without one is abandoned.
			if info, err := e.Info(); err == nil && time.Since(info.ModTime()) > time.Hour {
				_ = os.RemoveAll(dir)
			}
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 0 || processAlive(pid) {
			continue
		}
		_ = os.RemoveAll(dir)
	}
}

// processAlive reports whether a process with this PID exists.
func processAlive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// pickPort returns a port of 127.0.0.1 that is free now. It prefers ports
// below the kernel's ephemeral range, so that outgoing connections (a load
// generator reconnecting while the server restarts, say) cannot take the
// port while the server is down.
func pickPort() (int, error) {
	const lo = 10000
	hi := ephemeralLow()
	if hi-lo >= 1000 {
		for range 50 {
			port := lo + rand.IntN(hi-lo)
			l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
			if err == nil {
				_ = l.Close()
				return port, nil
			}
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pgtest: pick a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// ephemeralLow returns the first port of the kernel's ephemeral range.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil {
				return n
			}
		}
	}
	return 32768
}

// childEnv is the environment of initdb and postgres: ours without the PG*
// variables, which would otherwise change their defaults.
func childEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "PG") {
			env = append(env, kv)
		}
	}
	return env
}

// readFrom returns the content of the file at path from offset on, or an
// empty string.
func readFrom(path string, offset int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return ""
	}
	b, _ := io.ReadAll(f)
	return string(b)
}

// indentTail returns the last n lines of text, each on its own indented
// line, for appending to an error message.
func indentTail(text string, n int) string {
	lines := strings.Split(strings.TrimRight(text, "\n"), "\n")
	if len(lines) == 1 && lines[0] == "" {
		return ""
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	var b bytes.Buffer
	for _, l := range lines {
		b.WriteString("\n    ")
		b.WriteString(l)
	}
	return b.String()
}
