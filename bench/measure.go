package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat's CPU times: 100 on
// every Linux this runs on.
const clockTicks = 100

// selfCPU returns the CPU time (user + system) this process used so far.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// procTicks returns utime + stime of a process, in clock ticks.
func procTicks(pid int) (int64, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	// The command name is in parentheses and may hold spaces: fields are
	// counted from the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state); utime and stime are fields 14 and 15.
	if len(f) < 13 {
		return 0, false
	}
	u, err1 := strconv.ParseInt(f[11], 10, 64)
	s, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return u + s, true
}

// procStatusKB returns a "Vm…:" field of /proc/<pid>/status in KiB.
func procStatusKB(pid int, field string) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, field+":"); ok {
			v, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return v
		}
	}
	return 0
}

// meter measures the CPU time of a window: this process, the PostgreSQL
// processes serving it, and optionally a server process.
type meter struct {
	pool      *pgxpool.Pool
	app       string // application_name of this run's connections
	serverPID int

	self    time.Duration
	pg      map[int]int64
	server  int64
	started time.Time
	pgSeen  bool
}

// pgPIDs returns the PostgreSQL processes that work for this run: its own
// backends (by application_name) and the server's background processes
// (WAL writer, checkpointer, background writer, autovacuum). Backends of
// other clients of the same server are not counted.
func (m *meter) pgPIDs(ctx context.Context) map[int]int64 {
	out := map[int]int64{}
	rows, err := m.pool.Query(ctx, `SELECT pid FROM pg_stat_activity
		WHERE application_name = $1 OR backend_type NOT IN ('client backend', 'walsender')`, m.app)
	if err != nil {
		return out
	}
	defer rows.Close()
	for rows.Next() {
		var pid int
		if rows.Scan(&pid) == nil {
			if t, ok := procTicks(pid); ok {
				out[pid] = t
				m.pgSeen = true
			}
		}
	}
	return out
}

func (m *meter) start(ctx context.Context) {
	m.pg = m.pgPIDs(ctx)
	if m.serverPID != 0 {
		m.server, _ = procTicks(m.serverPID)
	}
	m.self = selfCPU()
	m.started = time.Now()
}

// stop ends the window and fills the sample's wall time and CPU figures.
// Backends that appeared during the window count from zero; those that
// exited during it are lost (the pools keep their connections, so few do).
func (m *meter) stop(ctx context.Context, s *Sample) {
	s.WallSeconds = time.Since(m.started).Seconds()
	s.CPUProcSeconds = (selfCPU() - m.self).Seconds()
	if m.serverPID != 0 {
		if t, ok := procTicks(m.serverPID); ok {
			s.CPUServerSeconds = float64(t-m.server) / clockTicks
		}
	}
	var ticks int64
	for pid, t := range m.pgPIDs(ctx) {
		ticks += t - m.pg[pid]
	}
	s.CPUPostgresSeconds = float64(ticks) / clockTicks
	if !m.pgSeen {
		s.Note = joinNote(s.Note, "PostgreSQL CPU not measured: its processes are not visible in /proc here")
	}
}

// setRates fills Rate and CPUPer1000 from Units and the window's figures.
func setRates(s *Sample) {
	if s.WallSeconds > 0 {
		s.Rate = float64(s.Units) / s.WallSeconds
	}
	if s.Units > 0 {
		s.CPUPer1000 = (s.CPUProcSeconds + s.CPUPostgresSeconds + s.CPUServerSeconds) / float64(s.Units) * 1000
	}
}

func joinNote(a, b string) string {
	if a == "" {
		return b
	}
	return a + "; " + b
}

// selfPeakMB is this process's peak resident set (maxrss), in MiB.
func selfPeakMB() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return float64(ru.Maxrss) / 1024 // KiB on Linux
}
