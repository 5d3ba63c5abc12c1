package relay_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/relay"
)

// kcatPath returns the kcat binary. Without one the test is skipped on a
// developer's machine and fails in CI (the CI environment variable is set),
// which installs it.
func kcatPath(t *testing.T) string {
	t.Helper()
	path, err := exec.LookPath("kcat")
	if err == nil {
		return path
	}
	if os.Getenv("CI") == "" {
		t.Skip("kcat is not on PATH (Debian: apt-get install kcat); the wire-format interop test needs it. " +
			"It is skipped only outside CI: with CI set, a missing kcat fails the test")
	}
	t.Fatalf("kcat is not on PATH and CI is set: .ci/run installs it (apt-get install kcat): %v", err)
	return ""
}

// kcat runs kcat with args and stdin, bounded by a timeout, and returns its
// standard output.
func kcat(t *testing.T, ctx context.Context, path string, stdin string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Stdin = strings.NewReader(stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	require.NoError(t, err, "kcat %s\nstderr:\n%s", strings.Join(args, " "), stderr.String())
	return stdout.String()
}

// TestKcatInterop proves the wire format with a client that shares no code
// with kafka-go: kcat (librdkafka) reads what the relay published, key and
// headers included, and the inbox consumes, once, a message kcat produced.
func TestKcatInterop(t *testing.T) {
	path := kcatPath(t)
	t.Parallel()
	e := setup(t)
	broker := strings.Join(e.kc.Addrs(), ",")

	// The relay's messages, read by kcat.
	want := map[string]string{} // message id -> key|payload
	for i := range 6 {
		key := fmt.Sprintf("order-%d", i%3)
		id := e.insert(t, topicOrders, key, i, func(m *store.Message) {
			m.Type = "order.created"
			m.Headers = map[string]string{"traceparent": fmt.Sprintf("00-%032x-%016x-01", i+1, i+1)}
		})
		want[id.String()] = fmt.Sprintf(`%s|{"seq":%d}`, key, i)
	}
	r := e.relay(t, e.writer(t), relay.Config{})
	published, failed := drain(t, e.ctx, r)
	require.Equal(t, len(want), published)
	require.Zero(t, failed)

	out := kcat(t, e.ctx, path, "", "-C", "-b", broker, "-t", topicOrders, "-o", "beginning", "-e", "-q",
		"-f", `%k|%h|%s\n`)
	t.Logf("kcat read what the relay published:\n%s", out)
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	require.Len(t, lines, len(want), "kcat output:\n%s", out)
	seen := map[string]bool{}
	for _, line := range lines {
		parts := strings.SplitN(line, "|", 3)
		require.Len(t, parts, 3, "line %q", line)
		key, rawHeaders, payload := parts[0], parts[1], parts[2]
		headers := map[string]string{}
		for kv := range strings.SplitSeq(rawHeaders, ",") {
			k, v, ok := strings.Cut(kv, "=")
			require.True(t, ok, "header %q of line %q", kv, line)
			headers[k] = v
		}
		id := headers[store.HeaderMessageID]
		require.Contains(t, want, id, "line %q: %s names no row", line, store.HeaderMessageID)
		require.Equal(t, want[id], key+"|"+payload, "line %q: key (the aggregate id) and payload", line)
		require.Equal(t, "order.created", headers[store.HeaderType])
		require.Regexp(t, `^00-[0-9a-f]{32}-[0-9a-f]{16}-01$`, headers["traceparent"])
		require.False(t, seen[id], "message %s read twice", id)
		seen[id] = true
	}

	// A message kcat produced, consumed by the inbox through a kafka-go
	// consumer group; the same message produced again has no second effect.
	charges := pgx.Identifier{e.schema, "charges"}.Sanitize()
	_, err := e.pool.Exec(e.ctx, `CREATE TABLE `+charges+` (message_id text NOT NULL, order_id text NOT NULL, body text NOT NULL)`)
	require.NoError(t, err)
	in, err := inbox.New(e.pool, &inbox.Config{Consumer: "payments", Schema: e.schema, Logger: quiet})
	require.NoError(t, err)
	kr := kafka.NewReader(kafka.ReaderConfig{
		Brokers:           e.kc.Addrs(),
		GroupID:           "payments-" + e.schema,
		Topic:             topicPayments,
		StartOffset:       kafka.FirstOffset,
		MaxWait:           100 * time.Millisecond,
		HeartbeatInterval: 200 * time.Millisecond,
		SessionTimeout:    6 * time.Second,
		RebalanceTimeout:  2 * time.Second,
		JoinGroupBackoff:  100 * time.Millisecond,
		ReadBackoffMin:    10 * time.Millisecond,
		ReadBackoffMax:    100 * time.Millisecond,
	})
	reader := &countingReader{r: kr}
	var handled sync.Map // message id -> inbox.Message
	c, err := in.NewConsumer(reader, &inbox.ConsumerConfig{Handlers: map[string]inbox.HandlerFunc{
		"charge.requested": func(ctx context.Context, tx pgx.Tx, msg inbox.Message) error {
			handled.Store(msg.ID, msg)
			_, err := tx.Exec(ctx, `INSERT INTO `+charges+` VALUES ($1, $2, $3)`, msg.ID, string(msg.Key), string(msg.Value))
			return err
		},
	}})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(e.ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() {
		cancel()
		require.NoError(t, <-done)
		require.NoError(t, kr.Close())
	}()

	effects := func() (n int, ids []string) {
		rows, err := e.pool.Query(e.ctx, `SELECT message_id FROM `+charges)
		require.NoError(t, err)
		ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		sort.Strings(ids)
		return len(ids), ids
	}
	produce := func() {
		kcat(t, e.ctx, path, `{"order_id":"order-9","amount":10}`+"\n", "-P", "-b", broker, "-t", topicPayments,
			"-H", store.HeaderType+"=charge.requested", "-H", store.HeaderMessageID+"=kcat-1", "-k", "order-9")
	}

	produce()
	waitFor(t, 30*time.Second, "the inbox to commit the message kcat produced", func() bool {
		return reader.commits.Load() >= 1
	})
	n, ids := effects()
	require.Equal(t, 1, n)
	require.Equal(t, []string{"kcat-1"}, ids)
	v, ok := handled.Load("kcat-1")
	require.True(t, ok)
	msg := v.(inbox.Message)
	require.Equal(t, "kcat-1", msg.ID)
	require.Equal(t, "charge.requested", msg.Type)
	require.Equal(t, []byte("order-9"), msg.Key)
	require.JSONEq(t, `{"order_id":"order-9","amount":10}`, string(msg.Value))

	produce() // the same message again: a redelivery, as far as the inbox can tell
	waitFor(t, 30*time.Second, "the inbox to commit the second copy", func() bool {
		return reader.commits.Load() >= 2
	})
	n, ids = effects()
	require.Equal(t, 1, n, "the second copy was deduplicated: still one effect (%v)", ids)
	msgs := e.read(t, topicPayments)
	require.Len(t, msgs, 2, "both copies reached the broker")
	for _, m := range msgs {
		got, _ := header(m, store.HeaderMessageID)
		require.Equal(t, "kcat-1", got)
		require.Equal(t, []byte("order-9"), m.Key)
	}
}

// countingReader is a kafka-go Reader that counts the offsets the consumer
// committed, so the test knows when a message has been handled.
type countingReader struct {
	r       *kafka.Reader
	commits atomic.Int64
}

func (c *countingReader) FetchMessage(ctx context.Context) (kafka.Message, error) {
	return c.r.FetchMessage(ctx)
}

func (c *countingReader) CommitMessages(ctx context.Context, msgs ...kafka.Message) error {
	err := c.r.CommitMessages(ctx, msgs...)
	if err == nil {
		c.commits.Add(int64(len(msgs)))
	}
	return err
}

// TestKcatEmptyPayloadIsNotANull settles, with a client that shares no code
// with kafka-go, what an empty payload becomes on the topic: a value of zero
// bytes, never a null value. A null value is a tombstone on a compacted
// topic, which would delete the key's earlier messages there. Both ways to
// write nothing are tried: outbox.Message.Payload nil, and an empty slice.
func TestKcatEmptyPayloadIsNotANull(t *testing.T) {
	path := kcatPath(t)
	t.Parallel()
	e := setup(t)
	ob, err := outbox.New(e.pool, e.schema)
	require.NoError(t, err)
	tx, err := e.pool.Begin(e.ctx)
	require.NoError(t, err)
	require.NoError(t, ob.InsertTx(e.ctx, tx, outbox.Message{Topic: topicOrders, Key: "nil-payload", Type: "t"}))
	require.NoError(t, ob.InsertTx(e.ctx, tx, outbox.Message{Topic: topicOrders, Key: "empty-payload", Type: "t", Payload: []byte{}}))
	require.NoError(t, tx.Commit(e.ctx))
	r := e.relay(t, e.writer(t), relay.Config{})
	published, failed := drain(t, e.ctx, r)
	require.Equal(t, 2, published)
	require.Zero(t, failed)

	// The control: a null value, which kcat produces for an empty line
	// with -Z, so that the reading below is seen telling the two apart.
	broker := strings.Join(e.kc.Addrs(), ",")
	kcat(t, e.ctx, path, "kcat-null\t\n", "-P", "-Z", "-K", "\t", "-b", broker, "-t", topicOrders)

	// %S is the value's length, -1 for a null value.
	out := kcat(t, e.ctx, path, "", "-C", "-b", broker, "-t", topicOrders, "-o", "beginning", "-e", "-q", "-f", `%k|%S\n`)
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	sort.Strings(lines)
	require.Equal(t, []string{"empty-payload|0", "kcat-null|-1", "nil-payload|0"}, lines, "kcat output:\n%s", out)
}
