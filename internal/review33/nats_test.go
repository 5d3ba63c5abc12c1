package review33_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/transport/natsbus"
)

// natsTopic is a fresh topic with a stream (Setup with opts), dropped when
// the test ends.
func natsTopic(t *testing.T, js jetstream.JetStream, opts *natsbus.SetupOpts) string {
	t.Helper()
	topic := uniq("r33.")
	dropStreams(t, topic)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := natsbus.Setup(ctx, js, []string{topic}, opts); err != nil {
		t.Fatalf("setup %s: %v", topic, err)
	}
	return topic
}

// natsMsg is a message of topic with key k, value v and a fresh message id.
func natsMsg(topic, k, v string) kafka.Message {
	return kafka.Message{Topic: topic, Key: []byte(k), Value: []byte(v),
		Headers: []kafka.Header{{Key: "sagaflow-message-id", Value: []byte(uniq("id-"))}}}
}

// fetchAll fetches and commits until n messages came or a fetch waited
// wait for nothing; it returns the values in order and the first fetch or
// commit error.
func fetchAll(t *testing.T, r interface {
	FetchMessage(context.Context) (kafka.Message, error)
	CommitMessages(context.Context, ...kafka.Message) error
}, n int, wait time.Duration) (string, error) {
	t.Helper()
	var got strings.Builder
	for i := 0; i < n; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		m, err := r.FetchMessage(ctx)
		cancel()
		if err != nil {
			return got.String(), err
		}
		got.Write(m.Value)
		// A context without a deadline, so that a reader's own bound
		// (natsbus ReaderOpts.AckTimeout) applies.
		err, hung := bounded(15*time.Second, func() error { return r.CommitMessages(context.Background(), m) })
		if hung {
			return got.String(), err
		}
		if err != nil {
			return got.String(), err
		}
	}
	return got.String(), nil
}

// TestNatsSetupRefusesBadOptionsNamingThem: negative options, a MaxBytes
// other than Unlimited below 1, an empty group and topics that cannot be
// subjects are refused before anything is sent, with ErrInvalidConfig and
// the field or the name in the message.
func TestNatsSetupRefusesBadOptionsNamingThem(t *testing.T) {
	t.Parallel()
	_, js := natsJS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	topic := uniq("r33.")
	dropStreams(t, topic)
	for _, c := range []struct {
		opts *natsbus.SetupOpts
		want string
	}{
		{&natsbus.SetupOpts{Partitions: -1}, "Partitions"},
		{&natsbus.SetupOpts{Partitions: math.MinInt}, "Partitions"},
		{&natsbus.SetupOpts{Replicas: -1}, "Replicas"},
		{&natsbus.SetupOpts{MaxAge: -1}, "MaxAge"},
		{&natsbus.SetupOpts{MaxAge: math.MinInt64}, "MaxAge"},
		{&natsbus.SetupOpts{MaxMsgSize: math.MinInt32}, "MaxMsgSize"},
		{&natsbus.SetupOpts{Duplicates: -1}, "Duplicates"},
		{&natsbus.SetupOpts{Duplicates: math.MaxInt64}, "Duplicates"}, // longer than MaxAge
		{&natsbus.SetupOpts{AckWait: -1, Groups: []string{"g"}}, "AckWait"},
		{&natsbus.SetupOpts{MaxBytes: -5}, "MaxBytes"},
		{&natsbus.SetupOpts{MaxBytes: math.MinInt64}, "MaxBytes"},
		{&natsbus.SetupOpts{Groups: []string{""}}, "group"},
	} {
		err := natsbus.Setup(ctx, js, []string{topic}, c.opts)
		if !errors.Is(err, natsbus.ErrInvalidConfig) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: Setup returned %v, want ErrInvalidConfig naming %s", *c.opts, err, c.want)
		}
	}
	for _, tp := range []string{"", "a\x00b", "a b", "a\tb", "a\r\nb", "*", ">", "a.*", "a.>", ".a", "a.", "a..b"} {
		err := natsbus.Setup(ctx, js, []string{tp}, nil)
		if !errors.Is(err, natsbus.ErrInvalidConfig) {
			t.Errorf("topic %q: Setup returned %v, want ErrInvalidConfig", tp, err)
		}
	}
	if _, err := js.Stream(ctx, natsbus.StreamName(topic)); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Errorf("a refused Setup made the stream anyway: %v", err)
	}
}

// TestNatsSetupExtremeValuesTheServerRefusesFailSetup: values the server
// refuses (1 ns MaxAge and Duplicates, 5 replicas on one server, a storage
// type that does not exist) make Setup fail, without a hang; the largest
// durations and sizes are kept as given.
func TestNatsSetupExtremeValuesTheServerRefusesFailSetup(t *testing.T) {
	t.Parallel()
	_, js := natsJS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, o := range []natsbus.SetupOpts{{MaxAge: 1}, {Duplicates: 1}, {Replicas: 5}, {Storage: 9}} {
		topic := uniq("r33.")
		dropStreams(t, topic)
		if err, hung := bounded(15*time.Second, func() error { return natsbus.Setup(ctx, js, []string{topic}, &o) }); err == nil || hung {
			t.Errorf("%+v: Setup returned %v (hung %v), want an error", o, err, hung)
		}
	}
	// The largest MaxBytes: the server may refuse to reserve it; an error
	// then, never a hang or a panic.
	for _, mb := range []int64{math.MaxInt64, 1 << 40} {
		tp := uniq("r33.")
		dropStreams(t, tp)
		if err, hung := bounded(15*time.Second, func() error {
			return natsbus.Setup(ctx, js, []string{tp}, &natsbus.SetupOpts{MaxBytes: mb})
		}); hung || (err != nil && strings.HasPrefix(err.Error(), "PANIC")) {
			t.Errorf("MaxBytes %d: %v (hung %v)", mb, err, hung)
		}
	}
	topic := natsTopic(t, js, &natsbus.SetupOpts{MaxAge: math.MaxInt64, Duplicates: math.MaxInt64, MaxMsgSize: math.MaxInt32, AckWait: math.MaxInt64, Groups: []string{"g"}})
	st, err := js.Stream(ctx, natsbus.StreamName(topic))
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	if cfg.MaxAge != math.MaxInt64 || cfg.Duplicates != math.MaxInt64 || cfg.MaxMsgSize != math.MaxInt32 {
		t.Errorf("stream config %v %v %v, want the largest values", cfg.MaxAge, cfg.Duplicates, cfg.MaxMsgSize)
	}
	// and it carries messages: write 3, read 3.
	w, err := natsbus.NewWriter(js, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.WriteMessages(ctx, natsMsg(topic, "k", "a"), natsMsg(topic, "k", "b"), natsMsg(topic, "k", "c")); err != nil {
		t.Fatal(err)
	}
	r, err := natsbus.NewReader(js, "g", []string{topic}, &natsbus.ReaderOpts{AckWait: math.MaxInt64, AckTimeout: math.MaxInt64})
	if err != nil {
		t.Fatal(err)
	}
	got, err := fetchAll(t, r, 3, 10*time.Second)
	if got != "abc" || err != nil {
		t.Errorf("read %q, %v; want abc", got, err)
	}
	if err, hung := bounded(15*time.Second, r.Close); err != nil || hung {
		t.Errorf("Close: %v (hung %v)", err, hung)
	}
}

// TestNatsCloseWithTheLongestPullWait (F5, fixed): Reader.Close "waits
// for the partitions' pulls in flight to end (at most PullWait)". NewReader
// took PullWait math.MaxInt64, and Close then sometimes did not return
// (still blocked after 15 s). PullWait is now bounded by PullWaitMax,
// named when refused; Close returns within PullWait (2 s here: at
// PullWaitMax the test would wait 30 s).
func TestNatsCloseWithTheLongestPullWait(t *testing.T) {
	t.Parallel()
	_, js := natsJS(t)
	for _, pw := range []time.Duration{math.MaxInt64, natsbus.PullWaitMax + 1} {
		_, err := natsbus.NewReader(js, "g", []string{"r33.any"}, &natsbus.ReaderOpts{PullWait: pw})
		if !errors.Is(err, natsbus.ErrInvalidConfig) || !strings.Contains(err.Error(), "PullWait") {
			t.Errorf("PullWait %v: NewReader returned %v, want ErrInvalidConfig naming PullWait", pw, err)
		}
	}
	topic := natsTopic(t, js, nil)
	w, err := natsbus.NewWriter(js, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	err = w.WriteMessages(ctx, natsMsg(topic, "k", "a"))
	cancel()
	_ = w.Close()
	if err != nil {
		t.Fatal(err)
	}
	const pullWait = 2 * time.Second
	r, err := natsbus.NewReader(js, "g", []string{topic}, &natsbus.ReaderOpts{PullWait: pullWait})
	if err != nil {
		t.Fatal(err)
	}
	got, err := fetchAll(t, r, 1, 10*time.Second)
	if got != "a" {
		t.Errorf("read %q (%v)", got, err)
	}
	time.Sleep(pullWait / 2) // a pull in flight, waiting on the server
	if err, hung := bounded(pullWait+5*time.Second, r.Close); err != nil || hung {
		t.Fatalf("Close with PullWait %v: %v (hung %v)", pullWait, err, hung)
	}
}

// TestNatsSetupPartitionsOfTheLargestInt (F2): SetupOpts.Partitions is
// "how many partitions each topic has"; no maximum is documented, and
// ErrInvalidConfig "wraps every problem with arguments or options found
// before anything is sent". Setup with math.MaxInt must return an error,
// not panic.
func TestNatsSetupPartitionsOfTheLargestInt(t *testing.T) {
	t.Parallel()
	_, js := natsJS(t)
	topic := uniq("r33.")
	dropStreams(t, topic)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	// A large but representable count is refused by the server (the
	// stream's config exceeds max_payload): an error, no panic.
	if err, hung := bounded(15*time.Second, func() error {
		return natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{Partitions: 100000})
	}); err == nil || hung || strings.HasPrefix(err.Error(), "PANIC") {
		t.Errorf("Partitions 100000: %v (hung %v), want an error", err, hung)
	}
	err, hung := bounded(15*time.Second, func() error {
		return natsbus.Setup(ctx, js, []string{topic}, &natsbus.SetupOpts{Partitions: math.MaxInt})
	})
	if hung || err == nil || strings.HasPrefix(err.Error(), "PANIC") || !errors.Is(err, natsbus.ErrInvalidConfig) {
		t.Errorf("Partitions math.MaxInt: Setup returned %v (hung %v), want ErrInvalidConfig naming Partitions", err, hung)
	}
}

// TestNatsReaderOptionsThatCannotWork (F1): NewReader "fails only on
// arguments" and refuses a too short AckWait ("AckWait 1ms is too short"),
// but takes PullWait 1 ns/1 µs and AckTimeout 1 ns/1 µs. With such a
// PullWait every fetch fails ("context deadline already exceeded") and
// nothing is ever delivered; with such an AckTimeout no commit ever
// succeeds and the partition never gets past its first message (MaxAckPending
// 1): it is redelivered after every AckWait, for ever. Either should be
// refused at NewReader, naming the field, or honoured (messages flow).
func TestNatsReaderOptionsThatCannotWork(t *testing.T) {
	t.Parallel()
	_, js := natsJS(t)
	// What held: negative values and a too short AckWait are refused.
	topic := natsTopic(t, js, nil)
	for _, o := range []natsbus.ReaderOpts{{AckWait: -1}, {PullWait: -1}, {AckTimeout: -1}, {AckWait: math.MinInt64}, {AckWait: 1}, {AckWait: time.Millisecond}} {
		_, err := natsbus.NewReader(js, "g", []string{topic}, &o)
		if !errors.Is(err, natsbus.ErrInvalidConfig) {
			t.Errorf("%+v: NewReader returned %v, want ErrInvalidConfig", o, err)
		}
	}
	// Bad group and topic names are refused or carried.
	for _, g := range []string{""} {
		if _, err := natsbus.NewReader(js, g, []string{topic}, nil); !errors.Is(err, natsbus.ErrInvalidConfig) {
			t.Errorf("group %q: NewReader returned %v, want ErrInvalidConfig", g, err)
		}
	}
	for _, tp := range []string{"a b", "a\x00b", "*", "a.>", ""} {
		if _, err := natsbus.NewReader(js, "g", []string{tp}, nil); !errors.Is(err, natsbus.ErrInvalidConfig) {
			t.Errorf("topic %q: NewReader returned %v, want ErrInvalidConfig", tp, err)
		}
	}

	for _, o := range []natsbus.ReaderOpts{{PullWait: 1}, {PullWait: time.Microsecond}, {AckTimeout: 1}, {AckTimeout: time.Microsecond}} {
		topic := natsTopic(t, js, nil)
		w, err := natsbus.NewWriter(js, nil)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := w.WriteMessages(ctx, natsMsg(topic, "k", "a"), natsMsg(topic, "k", "b"), natsMsg(topic, "k", "c")); err != nil {
			t.Fatal(err)
		}
		cancel()
		_ = w.Close()
		r, err := natsbus.NewReader(js, "g", []string{topic}, &o)
		if errors.Is(err, natsbus.ErrInvalidConfig) {
			continue // refused at construction: fine
		}
		if err != nil {
			t.Fatalf("%+v: NewReader: %v", o, err)
		}
		got, ferr := fetchAll(t, r, 3, 3*time.Second)
		_ = r.Close()
		if got != "abc" {
			t.Errorf("%+v: accepted by NewReader, but a consume loop read %q of abc; last error: %v", o, got, ferr)
		}
	}
}

// TestNatsReaderSmallestAckWaitKeepsAHeldMessage: with the smallest
// AckWait NewReader takes (100 ms), a member that holds a message for 2 s
// keeps it ("A running reader keeps the messages it holds alive, however
// long their handling takes"): another member of the group gets nothing
// meanwhile, and the commit succeeds.
func TestNatsReaderSmallestAckWaitKeepsAHeldMessage(t *testing.T) {
	t.Parallel()
	_, js := natsJS(t)
	topic := natsTopic(t, js, nil)
	w, err := natsbus.NewWriter(js, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := w.WriteMessages(ctx, natsMsg(topic, "k", "a"), natsMsg(topic, "k", "b")); err != nil {
		t.Fatal(err)
	}
	opts := &natsbus.ReaderOpts{AckWait: 100 * time.Millisecond}
	a, err := natsbus.NewReader(js, "g", []string{topic}, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	fctx, fcancel := context.WithTimeout(ctx, 5*time.Second)
	m, err := a.FetchMessage(fctx)
	fcancel()
	if err != nil || string(m.Value) != "a" {
		t.Fatalf("a fetched %q, %v", m.Value, err)
	}
	b, err := natsbus.NewReader(js, "g", []string{topic}, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	fctx, fcancel = context.WithTimeout(ctx, 2*time.Second)
	m2, err := b.FetchMessage(fctx)
	fcancel()
	if err == nil {
		t.Errorf("b fetched %q while a held a message of the partition", m2.Value)
	}
	if err := a.CommitMessages(ctx, m); err != nil {
		t.Errorf("a's commit after 2 s: %v", err)
	}
	got, err := fetchAll(t, b, 1, 5*time.Second)
	if got != "b" {
		t.Errorf("b then read %q (%v), want b", got, err)
	}
}

// TestNatsWriterBadTopicsDoNotHoldBackTheOthers: in one write, topics that
// cannot be subjects (NUL, space) are parked for good (invalid_topic),
// topics without a stream spend an attempt, and the good messages around
// them are published once, in order, with MetadataTTL at 1 ns and the
// largest duration; a negative MetadataTTL is refused.
func TestNatsWriterBadTopicsDoNotHoldBackTheOthers(t *testing.T) {
	t.Parallel()
	_, js := natsJS(t)
	for _, ttl := range []time.Duration{-1, math.MinInt64} {
		if _, err := natsbus.NewWriter(js, &natsbus.WriterOpts{MetadataTTL: ttl}); !errors.Is(err, natsbus.ErrInvalidConfig) || !strings.Contains(err.Error(), "MetadataTTL") {
			t.Errorf("MetadataTTL %v: NewWriter returned %v", ttl, err)
		}
	}
	for _, ttl := range []time.Duration{1, math.MaxInt64} {
		good := natsTopic(t, js, nil)
		w, err := natsbus.NewWriter(js, &natsbus.WriterOpts{MetadataTTL: ttl})
		if err != nil {
			t.Fatal(err)
		}
		msgs := []kafka.Message{
			natsMsg(good, "k", "a"),
			natsMsg("a\x00b", "k", "x"),
			natsMsg("a b", "k", "x"),
			natsMsg(uniq("r33.nostream."), "k", "x"),
			natsMsg(big, "k", "x"),
			natsMsg(good, "k", "b"),
		}
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		err, hung := bounded(15*time.Second, func() error { return w.WriteMessages(ctx, msgs...) })
		cancel()
		_ = w.Close()
		if hung {
			t.Fatalf("MetadataTTL %v: write hung", ttl)
		}
		var we kafka.WriteErrors
		if !errors.As(err, &we) || len(we) != len(msgs) {
			t.Fatalf("MetadataTTL %v: write returned %v", ttl, err)
		}
		for i, e := range we {
			var pe *relay.PublishError
			switch i {
			case 0, 5:
				if e != nil {
					t.Errorf("ttl %v msg %d: %v", ttl, i, e)
				}
			case 1, 2:
				if !errors.As(e, &pe) || !pe.Permanent || pe.Code != relay.CodeInvalidTopic {
					t.Errorf("ttl %v msg %d: %v, want permanent invalid_topic", ttl, i, e)
				}
			default:
				if e == nil || (errors.As(e, &pe) && pe.Outage) {
					t.Errorf("ttl %v msg %d: %v, want a failure that spends an attempt", ttl, i, e)
				}
			}
		}
		r, err := natsbus.NewReader(js, "g", []string{good}, nil)
		if err != nil {
			t.Fatal(err)
		}
		got, err := fetchAll(t, r, 3, 2*time.Second)
		_ = r.Close()
		if got != "ab" {
			t.Errorf("ttl %v: the good topic holds %q (%v), want ab once", ttl, got, err)
		}
	}
}

// TestNatsNamesTheServerCannotCarry (F6): ErrInvalidConfig "wraps every
// problem with arguments or options found before anything is sent to the
// server"; Setup refuses topics with spaces, control bytes or wildcards.
// A topic with invalid UTF-8 is not refused: Setup creates a stream whose
// subject the server stored as U+FFFD, then fails with a misleading
// partitions error (every later Setup too), and the stream is left behind;
// the writer then calls it a missing stream ("create it with
// natsbus.Setup") instead of an invalid topic. A group of 5000 bytes is
// taken by NewReader (ConsumerName "cuts" long groups) but every fetch
// fails for ever ("consumer description is too long").
func TestNatsNamesTheServerCannotCarry(t *testing.T) {
	t.Parallel()
	_, js := natsJS(t)
	bad := "r33." + uniq("") + ".\xff"
	dropStreams(t, bad)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	err := natsbus.Setup(ctx, js, []string{bad}, nil)
	if !errors.Is(err, natsbus.ErrInvalidConfig) {
		t.Errorf("topic with invalid UTF-8: Setup returned %v, want ErrInvalidConfig", err)
	}
	if _, serr := js.Stream(ctx, natsbus.StreamName(bad)); serr == nil {
		t.Errorf("the refused topic's stream was created anyway")
	}
	w, err := natsbus.NewWriter(js, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	werr := w.WriteMessages(ctx, natsMsg(bad, "k", "x"))
	var pe *relay.PublishError
	var we kafka.WriteErrors
	if errors.As(werr, &we) && len(we) == 1 {
		werr = we[0] // the batch's errors, one per message
	}
	if !errors.As(werr, &pe) || !pe.Permanent || pe.Code != relay.CodeInvalidTopic {
		t.Errorf("write to a topic with invalid UTF-8: %v, want permanent invalid_topic", werr)
	}

	topic := natsTopic(t, js, nil)
	r, err := natsbus.NewReader(js, big[:5000], []string{topic}, nil)
	if errors.Is(err, natsbus.ErrInvalidConfig) {
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	fctx, fcancel := context.WithTimeout(ctx, 3*time.Second)
	_, ferr := r.FetchMessage(fctx)
	fcancel()
	if ferr != nil && !errors.Is(ferr, context.DeadlineExceeded) {
		t.Errorf("a 5000-byte group was taken by NewReader but its fetch fails: %v", short(ferr.Error()))
	}
}
