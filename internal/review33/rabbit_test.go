package review33_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/transport/rabbitbus"
)

// rabbitDial is the machine's broker; the test is skipped without one.
func rabbitDial(t *testing.T) rabbitbus.DialFunc {
	t.Helper()
	dial := rabbitbus.Dial(rabbitURL())
	conn, err := dial()
	if err != nil {
		t.Skipf("no RabbitMQ at %s: %v", rabbitURL(), err)
	}
	_ = conn.Close()
	return dial
}

// TestRabbitRefusesBadNamesAndOptionsNamingThem: every bad option and name
// tried is refused with ErrInvalidConfig naming it, before anything is
// declared: partitions out of 1..1024 (−1, 1025, MaxInt), negative
// MaxLength, MaxMessageBytes, StandbyDelay, Prefetch out of 1..65535,
// Member outside 0..Members-1; exchanges with NUL, invalid UTF-8, 10 kB,
// amq.*; groups with NUL, invalid UTF-8, '/', empty, 10 kB, or whose queue
// name passes 255 bytes; topics with NUL, invalid UTF-8, space, wildcards,
// '/', empty, 250 and 10 kB bytes.
func TestRabbitRefusesBadNamesAndOptionsNamingThem(t *testing.T) {
	t.Parallel()
	dial := rabbitDial(t)
	ex := uniq("r33ex")
	t.Cleanup(func() { dropExchange(ex) })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	setup := func(topics []string, o rabbitbus.SetupOpts) error {
		conn, err := dial()
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		err, hung := bounded(20*time.Second, func() error { return rabbitbus.Setup(ctx, conn, topics, &o) })
		if hung {
			t.Fatalf("Setup %+v hung", o.Topology)
		}
		return err
	}
	topic := uniq("r33t")
	topo := rabbitbus.Topology{Exchange: ex, Partitions: 1}
	type tc struct {
		o    rabbitbus.SetupOpts
		want string
	}
	for _, c := range []tc{
		{rabbitbus.SetupOpts{Topology: rabbitbus.Topology{Exchange: ex, Partitions: -1}}, "Partitions"},
		{rabbitbus.SetupOpts{Topology: rabbitbus.Topology{Exchange: ex, Partitions: 1025}}, "Partitions"},
		{rabbitbus.SetupOpts{Topology: rabbitbus.Topology{Exchange: ex, Partitions: math.MaxInt}}, "Partitions"},
		{rabbitbus.SetupOpts{Topology: topo, MaxLength: -1}, "MaxLength"},
		{rabbitbus.SetupOpts{Topology: rabbitbus.Topology{Exchange: "a\x00b", Partitions: 1}}, "Exchange"},
		{rabbitbus.SetupOpts{Topology: rabbitbus.Topology{Exchange: "a\xffb", Partitions: 1}}, "Exchange"},
		{rabbitbus.SetupOpts{Topology: rabbitbus.Topology{Exchange: big, Partitions: 1}}, "Exchange"},
		{rabbitbus.SetupOpts{Topology: rabbitbus.Topology{Exchange: "amq.r33", Partitions: 1}}, "Exchange"},
		{rabbitbus.SetupOpts{Topology: topo, Groups: []string{"a\x00b"}}, "group"},
		{rabbitbus.SetupOpts{Topology: topo, Groups: []string{"a\xffb"}}, "group"},
		{rabbitbus.SetupOpts{Topology: topo, Groups: []string{"a/b"}}, "group"},
		{rabbitbus.SetupOpts{Topology: topo, Groups: []string{""}}, "group"},
		{rabbitbus.SetupOpts{Topology: topo, Groups: []string{big}}, "group"},
		{rabbitbus.SetupOpts{Topology: topo, Groups: []string{big[:250]}}, "queue name"},
	} {
		err := setup([]string{topic}, c.o)
		if !errors.Is(err, rabbitbus.ErrInvalidConfig) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s/%d/%d/%q: Setup returned %v, want ErrInvalidConfig naming %s", short(c.o.Exchange), c.o.Partitions, c.o.MaxLength, short(first(c.o.Groups)), err, c.want)
		}
	}
	for _, tp := range []string{"a\x00b", "a\xffb", "a b", "a.*", "a.#", "a/b", "", big, big[:250]} {
		err := setup([]string{tp}, rabbitbus.SetupOpts{Topology: topo, Groups: []string{"g"}})
		if !errors.Is(err, rabbitbus.ErrInvalidConfig) || !strings.Contains(err.Error(), "topic") {
			t.Errorf("topic %q: Setup returned %v", short(tp), err)
		}
		if _, err := rabbitbus.NewReader(dial, "g", []string{tp}, &rabbitbus.ReaderOpts{Topology: topo}); !errors.Is(err, rabbitbus.ErrInvalidConfig) {
			t.Errorf("topic %q: NewReader returned %v", short(tp), err)
		}
	}
	for _, o := range []rabbitbus.WriterOpts{{MaxMessageBytes: -1}, {MaxMessageBytes: math.MinInt}, {Topology: rabbitbus.Topology{Partitions: -1}}, {Topology: rabbitbus.Topology{Partitions: math.MaxInt}}, {Topology: rabbitbus.Topology{Exchange: "a\x00b"}}} {
		if _, err := rabbitbus.NewWriter(dial, &o); !errors.Is(err, rabbitbus.ErrInvalidConfig) {
			t.Errorf("writer %+v: %v", o, err)
		}
	}
	for _, o := range []rabbitbus.ReaderOpts{{Prefetch: -1}, {Prefetch: math.MaxInt}, {Prefetch: 65536}, {Members: -1}, {Members: 2, Member: 2}, {Members: 2, Member: -1}, {StandbyDelay: -1}, {StandbyDelay: math.MinInt64}, {MaxLength: -1}} {
		if _, err := rabbitbus.NewReader(dial, "g", []string{"t"}, &o); !errors.Is(err, rabbitbus.ErrInvalidConfig) {
			t.Errorf("reader %+v: %v", o, err)
		}
	}
}

// TestRabbitExtremesThatAreTakenWork: the largest MaxLength, Members,
// StandbyDelay and MaxMessageBytes are taken and honoured: a writer and a
// reader with them carry messages in order; in one write, messages that
// cannot be carried (bad topics, a 300-byte header name, headers larger
// than a frame) are parked for good with their codes and do not hold back
// the others, which arrive once each.
func TestRabbitExtremesThatAreTakenWork(t *testing.T) {
	t.Parallel()
	dial := rabbitDial(t)
	ex := uniq("r33ex")
	topic := uniq("r33t")
	group := uniq("r33g")
	topo := rabbitbus.Topology{Exchange: ex, Partitions: 2}
	t.Cleanup(func() { dropQueues([]string{group}, topic, 2); dropExchange(ex) })
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	conn, err := dial()
	if err != nil {
		t.Fatal(err)
	}
	err = rabbitbus.Setup(ctx, conn, []string{topic}, &rabbitbus.SetupOpts{Topology: topo, Groups: []string{group}, MaxLength: math.MaxInt})
	_ = conn.Close()
	if err != nil {
		t.Fatalf("Setup with MaxLength MaxInt: %v", err)
	}
	w, err := rabbitbus.NewWriter(dial, &rabbitbus.WriterOpts{Topology: topo, MaxMessageBytes: math.MaxInt})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	huge := strings.Repeat(big, 13)
	msgs := []kafka.Message{
		{Topic: topic, Key: []byte("k"), Value: []byte("a"), Headers: []kafka.Header{{Key: "sagaflow-message-id", Value: []byte(uniq("id"))}}},
		{Topic: "a\x00b", Key: []byte("k"), Value: []byte("x")},
		{Topic: "a\xffb", Key: []byte("k"), Value: []byte("x")},
		{Topic: big, Key: []byte("k"), Value: []byte("x")},
		{Topic: topic, Key: []byte("k"), Value: []byte("x"), Headers: []kafka.Header{{Key: big[:300], Value: []byte("v")}}},
		{Topic: topic, Key: []byte("k"), Value: []byte("x"), Headers: []kafka.Header{{Key: "h", Value: []byte(huge)}}},
		{Topic: topic, Key: []byte("k"), Value: []byte("b"), Headers: []kafka.Header{{Key: "sagaflow-message-id", Value: []byte(uniq("id"))}}},
	}
	werr, hung := bounded(25*time.Second, func() error { return w.WriteMessages(ctx, msgs...) })
	if hung {
		t.Fatal("write hung")
	}
	var we kafka.WriteErrors
	if !errors.As(werr, &we) || len(we) != len(msgs) {
		t.Fatalf("write: %v", werr)
	}
	want := map[int]string{1: relay.CodeInvalidTopic, 2: relay.CodeInvalidTopic, 3: relay.CodeInvalidTopic, 4: relay.CodeRejected, 5: relay.CodeTooLarge}
	for i, e := range we {
		var pe *relay.PublishError
		code, bad := want[i]
		switch {
		case !bad && e != nil:
			t.Errorf("msg %d: %v", i, e)
		case bad && (!errors.As(e, &pe) || !pe.Permanent || (pe.Code != code && !(code == relay.CodeRejected && pe.Code == ""))):
			t.Errorf("msg %d: %v, want permanent %s", i, e, code)
		}
	}
	r, err := rabbitbus.NewReader(dial, group, []string{topic}, &rabbitbus.ReaderOpts{Topology: topo, MaxLength: math.MaxInt, Members: math.MaxInt, StandbyDelay: math.MaxInt64})
	if err != nil {
		t.Fatal(err)
	}
	got, ferr := fetchAll(t, r, 3, 3*time.Second)
	if got != "ab" {
		t.Errorf("read %q (%v), want ab once", got, ferr)
	}
	if err, hung := bounded(10*time.Second, r.Close); err != nil || hung {
		t.Errorf("Close with the longest StandbyDelay: %v (hung %v)", err, hung)
	}
}

func first(s []string) string {
	if len(s) == 0 {
		return ""
	}
	return s[0]
}
