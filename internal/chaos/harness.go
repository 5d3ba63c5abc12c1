package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/natstest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
	"github.com/sagaflow/sagaflow/saga"
)

// NodeCommand returns a command that runs one node: the caller's own binary
// (a test binary, the chaos command) started again in node mode. The harness
// adds the node's environment, output and fault pipes.
type NodeCommand func() *exec.Cmd

// Env is one system under attack: a throwaway PostgreSQL server (so that it
// can be restarted), the bus (an in-process Kafka broker, or a throwaway
// nats-server with JetStream), the fake external service, and node
// processes. The parent only starts sagas and checks; all the work happens
// in the nodes.
type Env struct {
	PG      *pgtest.Server
	Kafka   *kafkatest.Cluster // with BusKafka
	NATS    *natstest.Server   // with BusNATS
	Service *Service
	Pool    *pgxpool.Pool // the parent's own, for starting sagas and checking
	Dir     string        // node logs
	// Sabotage, when set, makes the nodes started from now on run a broken
	// workload, to show that the checkers notice (see SabotageEffectsOutsideTx).
	Sabotage string
	// AllSteps runs the orders engines in Kafka mode; otherwise in the
	// hybrid mode, where only remote commands and replies cross Kafka.
	AllSteps bool
	// Bus is BusKafka or BusNATS.
	Bus string

	nc *nats.Conn // the parent's, with BusNATS: to check and to inject
	js jetstream.JetStream

	engine     *saga.Engine // never started: Start only inserts, Cancel records
	def        *saga.Definition[Order]
	slowDef    *saga.Definition[Order]
	foreignDef *saga.Definition[Order]
	parcelDef  *saga.Definition[Parcel]
	labelDef   *saga.Definition[Label]
	nodeCmd    NodeCommand

	mu         sync.Mutex
	nodes      []*Node
	started    map[string]Order      // every order the parent tried to start, by key
	parcels    map[string]Parcel     // every parcel the parent tried to start, by key
	ids        map[string]uuid.UUID  // their sagas, once started
	foreign    map[string]uuid.UUID  // sagas of ForeignSagaName, by key
	cancels    map[string]CancelDone // operator cancels, by order key
	injected   []Injected            // bad messages written to the topics
	poisonTurn int
}

// CancelDone is what an operator's cancel of an order got.
type CancelDone struct {
	// Accepted: the request was recorded (applied at once, or pending
	// until the running step's engine applies it). Otherwise the saga was
	// no longer running when asked.
	Accepted bool
	How      string // "cancel", "request" (as the CLI does) or "held" (a cancel whose transaction stayed open)
}

// NewEnv starts the servers and creates the schemas (and, over NATS, the
// streams). dir receives the nodes' logs (and the NATS server's store).
// bus is BusKafka (or "") or BusNATS. Close it when done.
func NewEnv(ctx context.Context, dir string, nodeCmd NodeCommand, allSteps bool, bus string) (env *Env, err error) {
	if err := checkBus(bus, allSteps); err != nil {
		return nil, err
	}
	if bus == "" {
		bus = BusKafka
	}
	e := &Env{Dir: dir, nodeCmd: nodeCmd, AllSteps: allSteps, Bus: bus, started: map[string]Order{}, parcels: map[string]Parcel{}, ids: map[string]uuid.UUID{},
		foreign: map[string]uuid.UUID{}, cancels: map[string]CancelDone{}}
	defer func() {
		if err != nil {
			e.Close()
		}
	}()
	if e.PG, err = pgtest.StartServer(ctx); err != nil {
		return nil, err
	}
	brokers := []string(nil)
	switch bus {
	case BusNATS:
		store := filepath.Join(dir, "nats-store")
		if err = os.MkdirAll(store, 0o755); err != nil {
			return nil, err
		}
		if e.NATS, err = natstest.StartServerLogging(store, filepath.Join(dir, NATSLog)); err != nil {
			return nil, err
		}
		if e.nc, e.js, err = ConnectNATS(e.NATS.URL(), "chaos-parent"); err != nil {
			return nil, err
		}
		if err = setupNATS(ctx, e.js); err != nil {
			return nil, err
		}
	default:
		if e.Kafka, err = kafkatest.Start(kafkatest.SeedTopics(4, Topics()...), kafkatest.GroupMinSessionTimeout(time.Second)); err != nil {
			return nil, err
		}
		brokers = e.Kafka.Addrs()
	}
	if e.Service, err = StartService(); err != nil {
		return nil, err
	}
	if e.Pool, err = NewPool(ctx, e.PG.ConnString(), 8); err != nil {
		return nil, err
	}
	if err = Setup(ctx, e.Pool); err != nil {
		return nil, err
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	ecfg := EngineConfig(brokers, quiet, allSteps)
	if bus == BusNATS {
		// Never started: the reader is never made.
		ecfg.Kafka.NewReader = func(group string, topics []string) saga.KafkaReader {
			return failedReader{errors.New("chaos: the parent's engine consumes nothing")}
		}
	}
	if e.engine, err = saga.New(e.Pool, ecfg); err != nil {
		return nil, err
	}
	e.def, e.slowDef = Definitions(External{}, 0, nil)
	e.foreignDef = ForeignDefinition()
	e.parcelDef, e.labelDef = ParcelDefinitions(0, !e.AllSteps)
	if err = e.engine.Register(e.def, e.slowDef, e.foreignDef, e.parcelDef, e.labelDef); err != nil {
		return nil, err
	}
	return e, nil
}

// Close kills every node and stops the servers.
func (e *Env) Close() {
	e.mu.Lock()
	nodes := e.nodes
	e.mu.Unlock()
	for _, n := range nodes {
		n.Kill()
	}
	if e.Pool != nil {
		e.Pool.Close()
	}
	if e.Service != nil {
		_ = e.Service.Close()
	}
	if e.Kafka != nil {
		e.Kafka.Close()
	}
	if e.nc != nil {
		e.nc.Close()
	}
	if e.NATS != nil {
		e.NATS.Kill()
	}
	if e.PG != nil {
		_ = e.PG.Stop(context.Background())
	}
}

// Node is one node process.
type Node struct {
	Name    string
	cmd     *exec.Cmd
	done    chan struct{}
	report  *bufio.Reader // the fault point the node stopped at
	release *os.File      // a line here lets it go on
	logPath string
}

// StartNode starts a node process with roles; armed, when not empty, is a
// fault spec (point@n) for a sagaflow_faults build.
func (e *Env) StartNode(name string, roles []string, armed string) (*Node, error) {
	nc := NodeConfig{DSN: e.PG.ConnString(), Service: e.Service.URL(), Roles: roles, Sabotage: e.Sabotage, AllSteps: e.AllSteps, Bus: e.Bus}
	if e.Bus == BusNATS {
		nc.NATSURL, nc.HeldFile = e.NATS.URL(), heldFile(e.Dir, name)
		_ = os.Remove(nc.HeldFile) // a killed node's: it held nothing since
	} else {
		nc.Brokers = e.Kafka.Addrs()
	}
	cfg, err := json.Marshal(nc)
	if err != nil {
		return nil, err
	}
	cmd := e.nodeCmd()
	cmd.Env = append(os.Environ(), NodeEnv+"="+string(cfg), "SAGAFLOW_FAULT="+armed)
	logPath := filepath.Join(e.Dir, name+".log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd.Stdout, cmd.Stderr = logf, logf
	reportR, reportW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	releaseR, releaseW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd.ExtraFiles = []*os.File{reportW, releaseR} // fds 3 and 4
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("chaos: start node %s: %w", name, err)
	}
	_ = reportW.Close()
	_ = releaseR.Close()
	n := &Node{Name: name, cmd: cmd, done: make(chan struct{}), report: bufio.NewReader(reportR), release: releaseW, logPath: logPath}
	go func() {
		_ = cmd.Wait()
		_ = reportR.Close()
		_ = releaseW.Close()
		close(n.done)
	}()
	e.mu.Lock()
	e.nodes = append(e.nodes, n)
	e.mu.Unlock()
	return n, nil
}

// WaitFault waits until the node stops at its armed point and returns the
// point's name.
func (n *Node) WaitFault(timeout time.Duration) (string, error) {
	type res struct {
		line string
		err  error
	}
	ch := make(chan res, 1)
	go func() {
		l, err := n.report.ReadString('\n')
		ch <- res{l, err}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			return "", fmt.Errorf("chaos: node %s exited before its fault point (see %s): %w", n.Name, n.logPath, r.err)
		}
		return r.line[:len(r.line)-1], nil
	case <-time.After(timeout):
		return "", fmt.Errorf("chaos: node %s did not reach its fault point within %s", n.Name, timeout)
	}
}

// Release lets a node stopped at its fault point go on.
func (n *Node) Release() { _, _ = n.release.WriteString("go\n") }

// Kill sends SIGKILL and waits for the process to be gone.
func (n *Node) Kill() {
	_ = n.cmd.Process.Signal(syscall.SIGKILL)
	<-n.done
}

// Pause stops the process with SIGSTOP; Resume continues it.
func (n *Node) Pause() error  { return n.cmd.Process.Signal(syscall.SIGSTOP) }
func (n *Node) Resume() error { return n.cmd.Process.Signal(syscall.SIGCONT) }

// Alive reports whether the process still runs.
func (n *Node) Alive() bool {
	select {
	case <-n.done:
		return false
	default:
		return true
	}
}

// Stop asks the node to stop (SIGTERM) and waits up to 15 s, then kills it.
func (n *Node) Stop() {
	_ = n.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-n.done:
	case <-time.After(15 * time.Second):
		n.Kill()
	}
}

// NewOrder makes the order with key, failing and slow at the given rates.
func NewOrder(key string, rng *rand.Rand, failRate, slowRate float64) Order {
	return Order{Key: key, Fail: rng.Float64() < failRate, Slow: rng.Float64() < slowRate}
}

// Start starts the saga of o, retrying while the database is away (a
// restart, say) until ctx ends. The business key makes the retries safe: a
// start whose commit was lost in a crash is either there once or not at all.
func (e *Env) Start(ctx context.Context, o Order) error {
	e.mu.Lock()
	e.started[o.Key] = o
	e.mu.Unlock()
	for {
		def := e.def
		if o.Slow {
			def = e.slowDef
		}
		st, err := saga.Start(ctx, e.engine, def, o, &saga.StartOpts{BusinessKey: o.Key})
		if err == nil {
			e.mu.Lock()
			e.ids[o.Key] = st.ID
			e.mu.Unlock()
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("chaos: start %s: %w (last error: %v)", o.Key, ctx.Err(), err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// StartForeign starts a saga of ForeignSagaName, which no node registers,
// and routes its first command to the order saga's command topic, which
// every engine consumes: as a newer engine would, during a rolling deploy.
// The engines cannot run it: they hold it (back to the outbox, published
// again later) and park it after UnknownSagaGrace. It retries through
// restarts, as Start does.
func (e *Env) StartForeign(ctx context.Context, key string) error {
	for {
		var id uuid.UUID
		err := pgx.BeginFunc(ctx, e.Pool, func(tx pgx.Tx) error {
			st, err := saga.StartTx(ctx, e.engine, tx, e.foreignDef, Order{Key: key}, &saga.StartOpts{BusinessKey: key})
			if err != nil {
				return err
			}
			id = st.ID
			if !e.AllSteps {
				// Hybrid: the command stays a direct one, which every
				// engine's claim passes over until UnknownSagaGrace.
				return nil
			}
			_, err = tx.Exec(ctx, "UPDATE "+OrdersSchema+".outbox SET topic = $1 WHERE saga_id = $2", Topics()[0], st.ID)
			return err
		})
		if err == nil {
			e.mu.Lock()
			e.foreign[key] = id
			e.mu.Unlock()
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("chaos: start foreign %s: %w (last error: %v)", key, ctx.Err(), err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Cancel cancels the saga of a started order as an operator would: with
// how "cancel" by Engine.Cancel, "request" by Engine.RequestCancel (as the
// CLI does), "held" by Engine.CancelTx in a transaction kept open for a
// second (the saga is busy meanwhile: its commands must be held, not
// wait in their partition). It retries through restarts, and records
// whether the request was accepted or the saga no longer ran.
func (e *Env) Cancel(ctx context.Context, key, how string) error {
	e.mu.Lock()
	id, ok := e.ids[key]
	e.mu.Unlock()
	if !ok {
		return fmt.Errorf("chaos: cancel %s: not started", key)
	}
	reason := "chaos: operator cancel (" + how + ")"
	for {
		var err error
		switch how {
		case "cancel":
			err = e.engine.Cancel(ctx, id, reason)
		case "request":
			err = e.engine.RequestCancel(ctx, id, reason)
		case "held":
			err = pgx.BeginFunc(ctx, e.Pool, func(tx pgx.Tx) error {
				if err := e.engine.CancelTx(ctx, tx, id, reason); err != nil {
					return err
				}
				select {
				case <-time.After(time.Second):
				case <-ctx.Done():
				}
				return nil
			})
		default:
			return fmt.Errorf("chaos: cancel %s: unknown way %q", key, how)
		}
		if err == nil || errors.Is(err, saga.ErrNotRunning) {
			e.mu.Lock()
			if prev, seen := e.cancels[key]; !seen || !prev.Accepted {
				e.cancels[key] = CancelDone{Accepted: err == nil, How: how}
			}
			e.mu.Unlock()
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("chaos: cancel %s: %w (last error: %v)", key, ctx.Err(), err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// WaitTerminal waits until every started order's and parcel's saga is
// terminal, every injected message that must be dead-lettered is, every
// foreign saga's command is parked, no cancel request is pending, every
// requested signal was sent and the outboxes are drained, or ctx ends.
func (e *Env) WaitTerminal(ctx context.Context) error {
	for {
		var open int
		err := e.Pool.QueryRow(ctx, "SELECT count(*) FROM "+OrdersSchema+".saga_instances WHERE status NOT IN ('completed', 'compensated', 'failed') AND saga_name <> $1",
			ForeignSagaName).Scan(&open)
		if err == nil && open == 0 {
			e.mu.Lock()
			started, foreign := len(e.started)+len(e.parcels), foreignIDs(e.foreign)
			topics, parts, offsets := positions(e.injected, true)
			e.mu.Unlock()
			var n, dead, parked, cancels, pending, unsent int
			err := e.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+OrdersSchema+`.saga_instances WHERE saga_name <> $5),
			    (SELECT count(*) FROM unnest($1::text[], $2::int[], $3::bigint[]) p(topic, part, off) WHERE `+deadAt+`),
			    -- Parked as the checkers count it (see parkedForeign).
			    (SELECT count(*) FROM (`+parkedForeign+`) f WHERE f.saga_id = ANY($4::uuid[]::text[])),
			    (SELECT count(*) FROM `+OrdersSchema+`.saga_cancel_requests),
			    (SELECT count(*) FROM `+OrdersSchema+`.outbox WHERE status = 'pending' AND delivery = 'relay')
			        + (SELECT count(*) FROM `+PaymentsSchema+`.outbox WHERE status = 'pending'),
			    (SELECT count(*) FROM `+signalRequests()+` WHERE sends < copies)`,
				topics, parts, offsets, foreign, ForeignSagaName).Scan(&n, &dead, &parked, &cancels, &pending, &unsent)
			if err == nil && n >= started && dead >= len(topics) && parked >= len(foreign) && cancels == 0 && pending == 0 && unsent == 0 {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return errors.New("chaos: not every saga ended in time")
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// parkedForeign lists the ids of the sagas whose command was parked as
// unknown_saga: from Kafka, as a dead letter of the foreign saga's command (a
// poison copy of it, parked as malformed, names the saga too, and must not
// count); in the hybrid mode, where its command never left PostgreSQL, as a
// dead direct outbox row with the parking in the saga's history.
const parkedForeign = `SELECT headers->>'sagaflow-saga-id' AS saga_id FROM ` + OrdersSchema + `.dead_letters
        WHERE reason LIKE 'unknown_saga:%'
    UNION SELECT h.saga_id::text FROM ` + OrdersSchema + `.saga_history h
        JOIN ` + OrdersSchema + `.outbox o ON o.saga_id = h.saga_id AND o.delivery = 'direct' AND o.status = 'dead'
        WHERE h.event = 'command_parked' AND h.error_code = 'unknown_saga'`

// deadAt is true when the message at p's position (topic, part, off) is in
// either consumer's dead letters.
const deadAt = `(EXISTS (SELECT 1 FROM ` + OrdersSchema + `.dead_letters d WHERE d.topic = p.topic AND d.kafka_partition = p.part AND d.kafka_offset = p.off)
    OR EXISTS (SELECT 1 FROM ` + PaymentsSchema + `.dead_letters d WHERE d.topic = p.topic AND d.kafka_partition = p.part AND d.kafka_offset = p.off))`

// positions returns the positions of the injected messages, only those that
// must be dead-lettered when must is set, as parallel arrays.
func positions(in []Injected, must bool) (topics []string, parts []int32, offsets []int64) {
	topics, parts, offsets = []string{}, []int32{}, []int64{}
	for _, p := range in {
		if must && !p.Must {
			continue
		}
		topics, parts, offsets = append(topics, p.Topic), append(parts, p.Partition), append(offsets, p.Offset)
	}
	return topics, parts, offsets
}

func foreignIDs(m map[string]uuid.UUID) []uuid.UUID {
	out := make([]uuid.UUID, 0, len(m))
	for _, id := range m {
		out = append(out, id)
	}
	return out
}

func (e *Env) startedCopy() map[string]Order {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make(map[string]Order, len(e.started))
	for k, v := range e.started {
		out[k] = v
	}
	return out
}

// LogTails returns the last lines of every node log in dir, for a failure
// message.
func LogTails(dir string, lines int) string {
	paths, _ := filepath.Glob(filepath.Join(dir, "*.log"))
	var b strings.Builder
	for _, p := range paths {
		raw, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		all := strings.Split(strings.TrimRight(string(raw), "\n"), "\n")
		fmt.Fprintf(&b, "--- %s (last %d of %d lines)\n%s\n", filepath.Base(p), min(lines, len(all)), len(all),
			strings.Join(all[max(0, len(all)-lines):], "\n"))
	}
	return b.String()
}

// HandOffLog begins the engine's warning that a step run at once after a
// reply ran past KafkaConfig.ReplyStepLimit and was handed to a worker.
const HandOffLog = "sagaflow handed a step run at once after a reply to an engine worker"

// LogCount counts the lines of the node logs in dir that contain s.
func LogCount(dir, s string) int {
	paths, _ := filepath.Glob(filepath.Join(dir, "*.log"))
	n := 0
	for _, p := range paths {
		raw, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		n += strings.Count(string(raw), s)
	}
	return n
}

// groupIDs are the consumer groups of the system: the engines' (the
// engine's default group) and the payments participant's, one per topic.
func groupIDs() []string {
	return []string{"sagaflow-engine-" + OrdersSchema, participantGroup(PaymentsTopic), participantGroup(SlowTopic)}
}

func participantGroup(topic string) string { return "payments-" + topic }

// EngineMembers is how many members an engine node has in the engines'
// consumer group: one per Kafka worker (EngineConfig's Workers).
const EngineMembers = 2

// WaitGroupsStable waits until the three consumer groups are stable with
// exactly the members of the live nodes: EngineMembers per engine node, one
// per participant node in each payments group.
//
// The harness attacks only a system whose groups have settled. The broker
// of the tests (kfake) keeps, forever, a member whose connection died while
// its JoinGroup request waited for the rebalance, unless that member led the
// group: the join's reply cannot be delivered, so its session timer is never
// started, and the leader's SyncGroup cancels the timer that would remove
// members that never sync. Such a member holds its partitions until some
// later rebalance. A Kafka broker starts every member's session timer when
// the join completes. Killing nodes only once their groups are stable keeps
// the matrix and the soak measuring sagaflow, not that difference.
//
// Over NATS there is no membership to settle (a partition's next message
// goes to whichever member pulls first): it waits for every group's
// consumers to exist.
func (e *Env) WaitGroupsStable(ctx context.Context, engines, participants int) error {
	if e.Bus == BusNATS {
		return e.waitNATSConsumers(ctx)
	}
	c := &kafka.Client{Addr: kafka.TCP(e.Kafka.Addrs()...), Timeout: 5 * time.Second}
	ids := groupIDs()
	want := map[string]int{ids[0]: engines * EngineMembers, ids[1]: participants, ids[2]: participants}
	last := "no answer yet"
	for {
		resp, err := c.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: ids})
		if err == nil {
			settled := true
			var b strings.Builder
			for _, g := range resp.Groups {
				fmt.Fprintf(&b, "%s: %s with %d of %d members; ", g.GroupID, g.GroupState, len(g.Members), want[g.GroupID])
				settled = settled && g.GroupState == "Stable" && len(g.Members) == want[g.GroupID]
			}
			if settled && len(resp.Groups) == len(want) {
				return nil
			}
			last = b.String()
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("chaos: consumer groups did not settle: %s", last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Groups describes the consumer groups on the broker: their state and
// members, with the partitions each holds. For a failure message when
// sagas are stuck.
func (e *Env) Groups(ctx context.Context) string {
	if e.Bus == BusNATS {
		return e.natsConsumers(ctx)
	}
	c := &kafka.Client{Addr: kafka.TCP(e.Kafka.Addrs()...), Timeout: 5 * time.Second}
	resp, err := c.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: groupIDs()})
	if err != nil {
		return "describe groups: " + err.Error()
	}
	var b strings.Builder
	for _, g := range resp.Groups {
		fmt.Fprintf(&b, "group %s: state %s, error %v, %d members\n", g.GroupID, g.GroupState, g.Error, len(g.Members))
		for _, m := range g.Members {
			fmt.Fprintf(&b, "  member %s (%s %s): %v\n", m.MemberID, m.ClientID, m.ClientHost, m.MemberAssignments.Topics)
		}
	}
	return b.String()
}
