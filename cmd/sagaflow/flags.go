package main

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/saga"
)

// parseInterspersed parses fs from args, allowing flags after positional
// arguments (`show <id> --json`), and returns the positional arguments.
// Everything after "--" is positional.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return positional, nil
		}
		if consumed := len(args) - len(rest); consumed > 0 && args[consumed-1] == "--" {
			return append(positional, rest...), nil
		}
		positional = append(positional, rest[0])
		args = rest[1:]
	}
}

// timeFlag is a flag.Value holding an RFC 3339 time.
type timeFlag struct{ t *time.Time }

func (f timeFlag) String() string {
	if f.t == nil || f.t.IsZero() {
		return ""
	}
	return f.t.Format(time.RFC3339Nano)
}

func (f timeFlag) Set(s string) error {
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return errors.New("not an RFC 3339 time such as 2026-01-02T15:04:05Z")
	}
	*f.t = t
	return nil
}

// timeVar defines an RFC 3339 time flag.
func timeVar(fs *flag.FlagSet, p *time.Time, name, usage string) {
	fs.Var(timeFlag{p}, name, usage)
}

// statuses are the saga statuses, in their order of life.
var statuses = []saga.Status{saga.StatusRunning, saga.StatusCompensating, saga.StatusCompleted,
	saga.StatusCompensated, saga.StatusFailed}

// statusFlag is a flag.Value holding a comma-separated list of statuses; it
// may be repeated.
type statusFlag struct{ s *[]saga.Status }

func (f statusFlag) String() string {
	if f.s == nil {
		return ""
	}
	parts := make([]string, len(*f.s))
	for i, s := range *f.s {
		parts[i] = string(s)
	}
	return strings.Join(parts, ",")
}

func (f statusFlag) Set(v string) error {
	for part := range strings.SplitSeq(v, ",") {
		s := saga.Status(strings.TrimSpace(part))
		if !slices.Contains(statuses, s) {
			return fmt.Errorf("unknown status %q (want one or more of %s)", s, statusNames())
		}
		*f.s = append(*f.s, s)
	}
	return nil
}

func statusNames() string {
	names := make([]string, len(statuses))
	for i, s := range statuses {
		names[i] = string(s)
	}
	return strings.Join(names, ", ")
}

// parseID parses a saga id given as the one positional argument of cmd.
func parseID(cmd string, args []string) (uuid.UUID, error) {
	switch {
	case len(args) == 0:
		return uuid.Nil, usageErrorf("%s: missing saga id (run 'sagaflow help %s')", cmd, cmd)
	case len(args) > 1:
		return uuid.Nil, usageErrorf("%s: unexpected argument %q after the saga id", cmd, args[1])
	}
	id, err := uuid.Parse(args[0])
	if err != nil {
		return uuid.Nil, usageErrorf("%s: saga id %q is not a UUID: %v", cmd, args[0], err)
	}
	return id, nil
}

// noArgs rejects positional arguments of a command that takes none.
func noArgs(cmd string, args []string) error {
	if len(args) > 0 {
		return usageErrorf("%s: unexpected argument %q", cmd, args[0])
	}
	return nil
}

// checkLimits checks the --max and --rate flags of the bulk commands
// against the engine's limits. A --max given is at least 1 (0 would mean
// the default, which is not what "--max 0" says); a --rate given is a
// positive number.
func checkLimits(cmd string, fs *flag.FlagSet, maxN int, rate float64) error {
	if err := checkMax(cmd, fs, maxN, saga.BulkReplayMaxLimit); err != nil {
		return err
	}
	if rate < 0 || math.IsNaN(rate) || math.IsInf(rate, 0) || flagSet(fs, "rate") && rate == 0 {
		return usageErrorf("%s: --rate %g: give a positive number of items per second (leave it out for the default)", cmd, rate)
	}
	return nil
}

// checkMax checks a --max flag: from 1 to limit when given.
func checkMax(cmd string, fs *flag.FlagSet, maxN, limit int) error {
	if maxN < 0 || maxN > limit || flagSet(fs, "max") && maxN == 0 {
		return usageErrorf("%s: --max %d is outside 1..%d (leave it out for the default)", cmd, maxN, limit)
	}
	return nil
}
