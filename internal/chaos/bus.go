package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/transport/natsbus"
)

// The buses a system can run over.
const (
	// BusKafka is an in-process Kafka broker (kfake): the default.
	BusKafka = "kafka"
	// BusNATS is a throwaway nats-server with JetStream, reached through
	// package transport/natsbus (the relays' writers, the engines' and the
	// participant's readers). Hybrid mode only.
	BusNATS = "nats"
)

// Over NATS, every topic's stream has NATSPartitions partitions, and every
// consumer NATSAckWait: how long a message held by a killed or paused node
// waits before JetStream gives it to another member of the group.
const (
	NATSPartitions = 4
	NATSAckWait    = 2 * time.Second
)

// checkBus refuses a bus the harness cannot run.
func checkBus(bus string, allSteps bool) error {
	switch bus {
	case "", BusKafka:
		return nil
	case BusNATS:
		if allSteps {
			return errors.New("chaos: Kafka mode (AllSteps) runs over Kafka only: run the NATS bus in the hybrid mode")
		}
		return nil
	}
	return fmt.Errorf("chaos: unknown bus %q (%s or %s)", bus, BusKafka, BusNATS)
}

// ConnectNATS connects to a NATS server for a node or the parent: it
// reconnects quickly and forever (the soak kills the server), and its
// JetStream context gives up on an acknowledgement that never comes.
func ConnectNATS(url, name string) (*nats.Conn, jetstream.JetStream, error) {
	nc, err := nats.Connect(url, nats.Name(name), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond),
		nats.Timeout(2*time.Second), nats.RetryOnFailedConnect(true))
	if err != nil {
		return nil, nil, fmt.Errorf("chaos: connect to NATS at %s: %w", url, err)
	}
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(10*time.Second))
	if err != nil {
		nc.Close()
		return nil, nil, fmt.Errorf("chaos: JetStream at %s: %w", url, err)
	}
	return nc, js, nil
}

// newNATSReader is a member of group that consumes topics over NATS, with
// the soak's ack wait.
func newNATSReader(js jetstream.JetStream, group string, topics []string) (*natsbus.Reader, error) {
	return natsbus.NewReader(js, group, topics, &natsbus.ReaderOpts{AckWait: NATSAckWait, PullWait: 500 * time.Millisecond,
		AckTimeout: 5 * time.Second})
}

// NATSLog is the file, in the soak's directory, that receives the
// nats-server's output across its restarts.
const NATSLog = "nats-server.log"

// natsRecovery returns what the nats-server said of its store on each start
// (its warnings, errors and restored streams), for a report of messages
// missing from it.
func (e *Env) natsRecovery() []string {
	raw, err := os.ReadFile(filepath.Join(e.Dir, NATSLog))
	if err != nil {
		return []string{fmt.Sprintf("no nats-server log: %v", err)}
	}
	var out []string
	for _, l := range strings.Split(string(raw), "\n") {
		if strings.HasPrefix(l, "--- natstest") || strings.Contains(l, "[WRN]") || strings.Contains(l, "[ERR]") ||
			strings.Contains(l, "Restored") || strings.Contains(l, "Recover") {
			out = append(out, l)
		}
	}
	return out
}

// setupNATS creates the stream of every topic of the workload.
func setupNATS(ctx context.Context, js jetstream.JetStream) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := natsbus.Setup(ctx, js, Topics(), &natsbus.SetupOpts{Partitions: NATSPartitions}); err != nil {
		return fmt.Errorf("chaos: set up the streams: %w", err)
	}
	return nil
}

// natsGroups lists the system's consumer groups over NATS with the topics
// each consumes: the engines' (the reply topics of the sagas with remote
// steps: the hybrid mode) and the payments participant's, one per topic.
func (e *Env) natsGroups() map[string][]string {
	return map[string][]string{
		"sagaflow-engine-" + OrdersSchema: e.engine.CommandTopics(),
		participantGroup(PaymentsTopic):   {PaymentsTopic},
		participantGroup(SlowTopic):       {SlowTopic},
	}
}

// waitNATSConsumers waits until every group's durable consumer of every
// partition exists (the readers create them as they start). JetStream has
// no group membership to settle: a partition's next message goes to
// whichever member pulls first.
func (e *Env) waitNATSConsumers(ctx context.Context) error {
	last := "no answer yet"
	for {
		missing := 0
		for group, topics := range e.natsGroups() {
			for _, topic := range topics {
				for p := range NATSPartitions {
					if _, err := e.js.Consumer(ctx, natsbus.StreamName(topic), natsbus.ConsumerName(group, p)); err != nil {
						missing++
						last = fmt.Sprintf("consumer %s of %s: %v", natsbus.ConsumerName(group, p), topic, err)
					}
				}
			}
		}
		if missing == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("chaos: NATS consumers not created: %d missing, last %s", missing, last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// natsConsumers describes every group's consumers: what each has delivered,
// acknowledged and still holds. For a failure message when sagas are stuck.
func (e *Env) natsConsumers(ctx context.Context) string {
	var b strings.Builder
	groups := e.natsGroups()
	for _, group := range slices.Sorted(maps.Keys(groups)) {
		for _, topic := range groups[group] {
			for p := range NATSPartitions {
				c, err := e.js.Consumer(ctx, natsbus.StreamName(topic), natsbus.ConsumerName(group, p))
				if err != nil {
					fmt.Fprintf(&b, "consumer %s of %s: %v\n", natsbus.ConsumerName(group, p), topic, err)
					continue
				}
				i := c.CachedInfo()
				fmt.Fprintf(&b, "consumer %s of %s: delivered %d, ack floor %d, ack pending %d, redelivered %d, pending %d, waiting pulls %d\n",
					i.Name, topic, i.Delivered.Stream, i.AckFloor.Stream, i.NumAckPending, i.NumRedelivered, i.NumPending, i.NumWaiting)
			}
		}
	}
	return b.String()
}

// readNATSTopic returns every message on topic's stream, read by sequence
// from the server's store, as a natsbus.Reader would present it (Offset is
// the stream sequence). A message whose headers nats.go cannot decode is
// skipped when skip says it was injected, and an error otherwise.
func (e *Env) readNATSTopic(ctx context.Context, topic string, skip func(partition int, seq uint64) bool) ([]kafka.Message, string, error) {
	s, err := e.js.Stream(ctx, natsbus.StreamName(topic))
	if err != nil {
		return nil, "", fmt.Errorf("chaos: read stream of %s: %w", topic, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, "", fmt.Errorf("chaos: read stream of %s: %w", topic, err)
	}
	// What the server says of the stream, for a report of missing
	// messages: a server that lost messages on recovery says so in Lost.
	state := fmt.Sprintf("stream %s: msgs=%d first=%d last=%d deleted=%d", natsbus.StreamName(topic),
		info.State.Msgs, info.State.FirstSeq, info.State.LastSeq, info.State.NumDeleted)
	if l := info.State.Lost; l != nil {
		state += fmt.Sprintf(" lost=%d msgs %v (%d bytes)", len(l.Msgs), l.Msgs, l.Bytes)
	}
	var out []kafka.Message
	if info.State.Msgs == 0 {
		return nil, state, nil
	}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		raw, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			// Which partition it was on is unknown: skip it if it was
			// injected on any.
			injected := false
			for p := range NATSPartitions {
				injected = injected || skip(p, seq)
			}
			if injected {
				continue
			}
			return nil, "", fmt.Errorf("chaos: read %s seq %d: %w", topic, seq, err)
		}
		p, _ := strconv.Atoi(raw.Subject[strings.LastIndexByte(raw.Subject, '.')+1:])
		m := kafka.Message{Topic: topic, Partition: p, Offset: int64(seq), Value: raw.Data}
		for name, values := range raw.Header {
			for _, v := range values {
				m.Headers = append(m.Headers, kafka.Header{Key: name, Value: []byte(v)})
			}
		}
		out = append(out, m)
	}
	return out, state, nil
}

// natsOrder puts headers in the order a natsbus.Reader returns them: by
// name (NATS keeps no order between names; values of one name keep
// theirs).
func natsOrder(hs []kgo.RecordHeader) []kgo.RecordHeader {
	hs = slices.Clone(hs)
	sort.SliceStable(hs, func(i, j int) bool { return hs[i].Key < hs[j].Key })
	return hs
}

// rawNATSMsg is a message to publish with the NATS protocol itself.
type rawNATSMsg struct {
	subject string
	headers []kgo.RecordHeader // written as they are, in this order
	data    []byte
}

// publishRawNATS publishes msgs to JetStream over a plain TCP connection
// speaking the NATS protocol (HPUB), past nats.go, which refuses header
// names that are not tokens, and returns each one's stream sequence. The
// key travels as natsbus.KeyHeader, as the writer sends it. Nothing sets
// Nats-Msg-Id, so a copy of a real message is stored as a message of its
// own. It retries only while it cannot connect: once something was sent,
// a failure is an error (a retry could store a message twice, at a
// position nobody recorded).
func publishRawNATS(ctx context.Context, addr string, msgs []rawNATSMsg) ([]uint64, error) {
	var conn net.Conn
	for {
		var err error
		d := net.Dialer{Timeout: 2 * time.Second}
		if conn, err = d.DialContext(ctx, "tcp", addr); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("chaos: poison over NATS: connect: %w", err)
		case <-time.After(200 * time.Millisecond):
		}
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	rd := bufio.NewReader(conn)
	line, err := rd.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "INFO ") {
		return nil, fmt.Errorf("chaos: poison over NATS: no INFO from the server: %q %v", line, err)
	}
	inbox := "_INBOX.chaos" + strings.ReplaceAll(uuid.NewString(), "-", "")
	var b strings.Builder
	b.WriteString(`CONNECT {"verbose":false,"pedantic":false,"headers":true,"no_responders":true,"protocol":1,"name":"chaos-poison"}` + "\r\n")
	b.WriteString("SUB " + inbox + ".* 1\r\n")
	for i, m := range msgs {
		var h strings.Builder
		h.WriteString("NATS/1.0\r\n")
		for _, kv := range m.headers {
			h.WriteString(kv.Key + ": " + string(kv.Value) + "\r\n")
		}
		h.WriteString("\r\n")
		fmt.Fprintf(&b, "HPUB %s %s.%d %d %d\r\n%s%s\r\n", m.subject, inbox, i, h.Len(), h.Len()+len(m.data), h.String(), m.data)
	}
	b.WriteString("PING\r\n")
	if _, err := conn.Write([]byte(b.String())); err != nil {
		return nil, fmt.Errorf("chaos: poison over NATS: send: %w", err)
	}
	seqs := make([]uint64, len(msgs))
	got := 0
	for got < len(msgs) {
		line, err := rd.ReadString('\n')
		if err != nil {
			return nil, fmt.Errorf("chaos: poison over NATS: %d of %d acknowledged: %w", got, len(msgs), err)
		}
		line = strings.TrimRight(line, "\r\n")
		f := strings.Fields(line)
		switch {
		case len(f) == 0, f[0] == "PONG", f[0] == "+OK":
		case f[0] == "PING":
			_, _ = conn.Write([]byte("PONG\r\n"))
		case f[0] == "-ERR":
			return nil, fmt.Errorf("chaos: poison over NATS: server: %s", line)
		case (f[0] == "MSG" && len(f) == 4) || (f[0] == "HMSG" && len(f) == 5):
			total, _ := strconv.Atoi(f[len(f)-1])
			hdr := 0
			if f[0] == "HMSG" {
				hdr, _ = strconv.Atoi(f[3])
			}
			body := make([]byte, total+2)
			if _, err := readFull(rd, body); err != nil {
				return nil, fmt.Errorf("chaos: poison over NATS: read an acknowledgement: %w", err)
			}
			i, err := strconv.Atoi(f[1][strings.LastIndexByte(f[1], '.')+1:])
			if err != nil || i < 0 || i >= len(msgs) {
				return nil, fmt.Errorf("chaos: poison over NATS: an answer on %q", f[1])
			}
			var ack struct {
				Stream    string `json:"stream"`
				Seq       uint64 `json:"seq"`
				Duplicate bool   `json:"duplicate"`
				Error     *struct {
					Description string `json:"description"`
				} `json:"error"`
			}
			payload := body[hdr:total]
			if err := json.Unmarshal(payload, &ack); err != nil || ack.Seq == 0 {
				return nil, fmt.Errorf("chaos: poison over NATS: message %d to %s: no acknowledgement: %q", i, msgs[i].subject, body[:total])
			}
			if ack.Error != nil || ack.Duplicate {
				return nil, fmt.Errorf("chaos: poison over NATS: message %d to %s refused: %q", i, msgs[i].subject, payload)
			}
			if seqs[i] == 0 {
				got++
			}
			seqs[i] = ack.Seq
		default:
			return nil, fmt.Errorf("chaos: poison over NATS: unexpected %q", line)
		}
	}
	return seqs, nil
}

func readFull(rd *bufio.Reader, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		m, err := rd.Read(b[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// Held is a message a node had fetched and not committed yet, as the node
// reports it (see heldLog).
type Held struct {
	Group     string
	Topic     string
	Partition int
	Seq       uint64
}

func (h Held) String() string {
	return fmt.Sprintf("%s@%s/%d/%d", h.Group, h.Topic, h.Partition, h.Seq)
}

// heldLog keeps, in a file, the messages the node's readers fetched and
// have not committed: so that the parent can SIGKILL a node while it holds
// unacknowledged messages, and know which ones JetStream must redeliver.
// The file is replaced whole (written aside and renamed) at every change.
type heldLog struct {
	path string

	mu   sync.Mutex
	held map[Held]int
}

func newHeldLog(path string) *heldLog { return &heldLog{path: path, held: map[Held]int{}} }

func (l *heldLog) change(group string, msgs []kafka.Message, delta int) {
	if l == nil || l.path == "" {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, m := range msgs {
		h := Held{group, m.Topic, m.Partition, uint64(m.Offset)}
		if l.held[h] += delta; l.held[h] <= 0 {
			delete(l.held, h)
		}
	}
	var b strings.Builder
	for h := range l.held {
		fmt.Fprintf(&b, "%s\t%s\t%d\t%d\n", h.Group, h.Topic, h.Partition, h.Seq)
	}
	tmp := l.path + ".tmp"
	if err := os.WriteFile(tmp, []byte(b.String()), 0o644); err == nil {
		_ = os.Rename(tmp, l.path)
	}
}

// ReadHeld reads the messages a node reports holding (see heldLog).
func ReadHeld(path string) []Held {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	var out []Held
	for _, line := range strings.Split(strings.TrimSpace(string(raw)), "\n") {
		f := strings.Split(line, "\t")
		if len(f) != 4 {
			continue
		}
		p, err1 := strconv.Atoi(f[2])
		seq, err2 := strconv.ParseUint(f[3], 10, 64)
		if err1 == nil && err2 == nil {
			out = append(out, Held{f[0], f[1], p, seq})
		}
	}
	return out
}

// heldFile is where the node of slot name reports what it holds.
func heldFile(dir, name string) string { return filepath.Join(dir, name+".held") }

// busReader is what the node's consumers read from.
type busReader interface {
	FetchMessage(ctx context.Context) (kafka.Message, error)
	CommitMessages(ctx context.Context, msgs ...kafka.Message) error
	Close() error
}

// heldReader reports what its reader holds to a heldLog.
type heldReader struct {
	busReader
	group string
	log   *heldLog
}

func (r *heldReader) FetchMessage(ctx context.Context) (kafka.Message, error) {
	m, err := r.busReader.FetchMessage(ctx)
	if err == nil {
		r.log.change(r.group, []kafka.Message{m}, 1)
	}
	return m, err
}

func (r *heldReader) CommitMessages(ctx context.Context, msgs ...kafka.Message) error {
	err := r.busReader.CommitMessages(ctx, msgs...)
	// Committed or not, the reader no longer holds them: a failed ack
	// comes back after the ack wait, as from a dead node.
	r.log.change(r.group, msgs, -1)
	return err
}

// failedReader is a reader that could not be made: it returns why.
type failedReader struct{ err error }

func (r failedReader) FetchMessage(context.Context) (kafka.Message, error) {
	return kafka.Message{}, r.err
}
func (r failedReader) CommitMessages(context.Context, ...kafka.Message) error {
	return r.err
}
func (r failedReader) Close() error { return nil }

// ackedPast reports whether h's consumer acknowledged h's message: with one
// message in flight per partition (MaxAckPending 1), that is its ack
// floor reaching the message's sequence.
func (e *Env) ackedPast(ctx context.Context, h Held) (bool, error) {
	c, err := e.js.Consumer(ctx, natsbus.StreamName(h.Topic), natsbus.ConsumerName(h.Group, h.Partition))
	if err != nil {
		return false, err
	}
	return c.CachedInfo().AckFloor.Stream >= h.Seq, nil
}
