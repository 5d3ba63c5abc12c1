//go:build sagaflow_faults

package chaos_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/chaos"
	"github.com/sagaflow/sagaflow/internal/fault"
	"github.com/sagaflow/sagaflow/internal/natstest"
)

var (
	seeds = flag.Int("chaos.seeds", 1, "seeds per cell of the crash-point matrix")
	soak  = flag.Duration("chaos.soak", 45*time.Second, "how long the short soak attacks the system")
)

// nodeCmd runs this test binary again as a node (TestNode).
func nodeCmd() *exec.Cmd { return exec.Command(os.Args[0], "-test.run=^TestNode$", "-test.count=1") }

// TestNode is the body of a node process; it runs only as the child of the
// other tests, which set its configuration.
func TestNode(t *testing.T) {
	if os.Getenv(chaos.NodeEnv) == "" {
		t.Skip("runs only as a node process started by the chaos tests")
	}
	cfg, err := chaos.NodeConfigFromEnv()
	require.NoError(t, err)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	require.NoError(t, chaos.RunNode(ctx, cfg))
}

// TestCrashMatrix runs every crash point under every fault, with
// -chaos.seeds seeds each, in the hybrid mode, and under SIGKILL in Kafka
// mode too (see chaos.MatrixCells): no saga lost, no database effect
// doubled, every saga terminal within the deadline after recovery.
func TestCrashMatrix(t *testing.T) {
	t.Parallel()
	require.True(t, fault.Enabled)
	for _, c := range chaos.MatrixCells(fault.Points, chaos.Faults, *seeds) {
		t.Run(c.String(), func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			res, err := chaos.RunCell(context.Background(), dir, nodeCmd, c)
			require.NoError(t, err, chaos.LogTails(dir, 40))
			t.Logf("%s hit=%d settled=%s in %s\n%s\n%s\n%s\n%s", c, res.Hit, res.Settle.Round(time.Millisecond), res.Duration.Round(time.Millisecond),
				res.Report.Line(), res.Report.Detail(), res.Report.WaitLine(), res.Report.PoisonLine())
			require.True(t, res.Report.OK(), "invariants broken:\n%s\n%s\n%s\n%s\n%s", res.Report.Line(), res.Report.Detail(),
				strings.Join(res.Report.Violations, "\n"), strings.Join(res.Report.Failures, "\n"), chaos.LogTails(dir, 40))
		})
	}
}

// TestSoakShort is the short chaos soak of `make test`: about a minute of
// attacks on two engine and two participant nodes (`make chaos` runs the
// long one). It ends with the report line, and every invariant must hold.
func TestSoakShort(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	res, err := chaos.RunSoak(context.Background(), dir, nodeCmd, chaos.SoakConfig{
		Duration: *soak, Rate: 12, Engines: 2, Participants: 2, Seed: 1, Deadline: 3 * time.Minute, Logf: t.Logf,
	})
	require.NoError(t, err, chaos.LogTails(dir, 40))
	t.Logf("soak of %s\n%s\n%s\n%s\n%s\n%s", res.Duration.Round(time.Second), res.Report.Line(), res.Report.Detail(), res.Report.WaitLine(),
		res.Report.PoisonLine(), res.ActionsLine())
	require.True(t, res.Report.OK(), "invariants broken:\n%s\n%s\n%s\n%s\n%s\n%s", res.Report.Line(), res.Report.Detail(),
		strings.Join(res.Report.Violations, "\n"), strings.Join(res.Report.Failures, "\n"), strings.Join(res.Report.BusState, "\n"),
		chaos.LogTails(dir, 40))
	require.Positive(t, res.Actions["sigkill"]+res.Actions["pg_restart"]+res.Actions["broker_outage"]+res.Actions["sigstop"],
		"the soak attacked nothing")
	// Dawdling orders (see chaos.DawdleFor) reach the hand-off of a step
	// that runs past the reply worker's limit.
	require.Positive(t, chaos.LogCount(dir, chaos.HandOffLog), "no step was handed from a reply worker to an engine worker")
	// Stalled orders (see chaos.StallFor) had a statement cut by their
	// step's timeout.
	require.Positive(t, res.Report.StallsCut, "no statement was cut by its step's timeout")
}

// TestSoakShortNATS is the short chaos soak over NATS JetStream (a
// throwaway nats-server): the same workload, checks and attacks, with the
// broker outage a SIGKILL of the server and its restart on the same store,
// and nodes killed while they hold messages they have not acknowledged, so
// that JetStream redelivers those to the surviving nodes after the ack
// wait, and sometimes the node that took one is killed in turn. Every
// message a killed node held must be acknowledged later by another.
func TestSoakShortNATS(t *testing.T) {
	t.Parallel()
	if _, err := os.Stat("/usr/sbin/nats-server"); err != nil {
		if _, err := natstest.Binary(); err != nil {
			t.Skipf("no nats-server to run the soak over NATS: %v", err)
		}
	}
	dir := t.TempDir()
	if keep := os.Getenv("CHAOS_KEEP_DIR"); keep != "" {
		// The node logs whole, kept after the test, to study a failure.
		dir = filepath.Join(keep, fmt.Sprintf("nats-%d", time.Now().UnixNano()))
		require.NoError(t, os.MkdirAll(dir, 0o755))
		t.Logf("the soak's logs go to %s", dir)
	}
	res, err := chaos.RunSoak(context.Background(), dir, nodeCmd, chaos.SoakConfig{
		Duration: *soak, Rate: 12, Engines: 2, Participants: 2, Seed: 1, Deadline: 3 * time.Minute, Bus: chaos.BusNATS, Logf: t.Logf,
	})
	require.NoError(t, err, chaos.LogTails(dir, 40))
	t.Logf("NATS soak of %s\n%s\n%s\n%s\n%s\n%s", res.Duration.Round(time.Second), res.Report.Line(), res.Report.Detail(), res.Report.WaitLine(),
		res.Report.PoisonLine(), res.ActionsLine())
	require.True(t, res.Report.OK(), "invariants broken:\n%s\n%s\n%s\n%s\n%s\n%s", res.Report.Line(), res.Report.Detail(),
		strings.Join(res.Report.Violations, "\n"), strings.Join(res.Report.Failures, "\n"), strings.Join(res.Report.BusState, "\n"),
		chaos.LogTails(dir, 40))
	require.Positive(t, res.Actions["sigkill"]+res.Actions["pg_restart"]+res.Actions["broker_outage"]+res.Actions["sigstop"],
		"the soak attacked nothing")
	require.Positive(t, res.Actions["redelivery_kill"], "no node was killed while it held unacknowledged messages")
	require.Positive(t, res.Actions["redelivered"], "no message a killed node held was redelivered and acknowledged by another")
	require.Positive(t, res.Report.PoisonInjected, "no poison was published over NATS")
}

// TestSoakShortNATSRefusesKafkaMode: Kafka mode (every step over the bus)
// runs over Kafka only, and says so.
func TestSoakShortNATSRefusesKafkaMode(t *testing.T) {
	_, err := chaos.RunSoak(context.Background(), t.TempDir(), nodeCmd, chaos.SoakConfig{
		Duration: time.Second, Rate: 1, Engines: 1, Participants: 1, Deadline: time.Second, Bus: chaos.BusNATS, AllSteps: true,
	})
	require.ErrorContains(t, err, "Kafka mode (AllSteps) runs over Kafka only")
	_, err = chaos.RunSoak(context.Background(), t.TempDir(), nodeCmd, chaos.SoakConfig{
		Duration: time.Second, Rate: 1, Engines: 1, Participants: 1, Deadline: time.Second, Bus: "carrier-pigeon",
	})
	require.ErrorContains(t, err, `unknown bus "carrier-pigeon"`)
}

// runControl runs the crash cell at point, killed there with seed 1, with
// the workload broken by sabotage, and logs its report's summary, what
// detail says of it, and its violations.
func runControl(t *testing.T, point, sabotage string, detail func(*chaos.Report) string) *chaos.Report {
	t.Helper()
	c := chaos.Cell{Point: point, Fault: chaos.FaultKill, Seed: 1, Sabotage: sabotage}
	dir := t.TempDir()
	res, err := chaos.RunCell(context.Background(), dir, nodeCmd, c)
	require.NoError(t, err, chaos.LogTails(dir, 40))
	t.Logf("%s\n%s\n%s", res.Report.Line(), detail(res.Report), strings.Join(res.Report.Violations, "\n"))
	return res.Report
}

// TestCheckersCatchADualWrite is the negative control of the matrix: the
// same cell with a workload that writes its effects outside the step's
// transaction must be reported as doubling effects. A checker that cannot
// fail would pass it.
func TestCheckersCatchADualWrite(t *testing.T) {
	t.Parallel()
	r := runControl(t, fault.EngineAfterHandler, chaos.SabotageEffectsOutsideTx, (*chaos.Report).Detail)
	require.False(t, r.OK())
	require.Positive(t, r.DBEffectsDoubled, "the step killed after its handler ran wrote its effect twice")
}

// TestCheckersCatchAnUnsignedBus is the negative control of the forgeries:
// the same cell with nodes that neither sign nor verify must be reported
// as letting forged messages through (they are processed, not
// dead-lettered).
func TestCheckersCatchAnUnsignedBus(t *testing.T) {
	t.Parallel()
	r := runControl(t, fault.EngineAfterCommit, chaos.SabotageNoSigning, func(r *chaos.Report) string {
		return r.Detail() + "\n" + r.PoisonLine()
	})
	require.False(t, r.OK())
	require.Positive(t, r.PoisonMissed, "forged messages were processed, not refused")
}

// TestCheckersCatchALostSignal is the negative control of the waits: the
// same cell with a signaller that deletes each signal, and its wake-up, in
// the signal's transaction, as an engine that lost it would, must be
// reported as leaving parcels stuck (those whose signal came while they
// already waited at the await).
func TestCheckersCatchALostSignal(t *testing.T) {
	t.Parallel()
	r := runControl(t, fault.EngineWaitAfterCommit, chaos.SabotageLostSignal, (*chaos.Report).WaitLine)
	require.False(t, r.OK())
	require.Positive(t, r.ParcelsStuck, "a parcel whose signal was lost is not reported stuck")
}

// TestCheckersCatchNothingWhenWakeUpsAreLost is the positive control of
// the same cell: a signaller that deletes only each signal's wake-up (as
// an engine that skipped it would) leaves the signals pending, and the
// rescuer wakes the parcels again (RescueResult.Woken): none is stuck.
// Before the rescuer did, this was the negative control.
func TestCheckersCatchNothingWhenWakeUpsAreLost(t *testing.T) {
	t.Parallel()
	r := runControl(t, fault.EngineWaitAfterCommit, chaos.SabotageLostWakeUp, (*chaos.Report).WaitLine)
	require.True(t, r.OK(), "violations: %v", r.Violations)
	require.Zero(t, r.ParcelsStuck)
	require.Positive(t, r.SignalsReceived, "signals were delivered")
}
