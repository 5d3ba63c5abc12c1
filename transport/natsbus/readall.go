package natsbus

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"
)

// ReadAll returns every message topic's stream holds, in stream order, as a
// Reader hands them out (Partition from the subject, Offset the stream
// sequence), without acknowledging anything: for checks and tools, not for
// consuming.
func ReadAll(ctx context.Context, js jetstream.JetStream, topic string) ([]kafka.Message, error) {
	st, err := js.Stream(ctx, StreamName(topic))
	if err != nil {
		return nil, fmt.Errorf("natsbus: read %s: %w", topic, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("natsbus: read %s: %w", topic, err)
	}
	last := info.State.LastSeq
	if info.State.Msgs == 0 {
		return nil, nil
	}
	c, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return nil, fmt.Errorf("natsbus: read %s: %w", topic, err)
	}
	var out []kafka.Message
	for {
		batch, err := c.Fetch(256, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return nil, fmt.Errorf("natsbus: read %s: %w", topic, err)
		}
		n := 0
		var seq uint64
		for m := range batch.Messages() {
			n++
			p := -1
			if i := strings.LastIndexByte(m.Subject(), '.'); i >= 0 {
				p, _ = strconv.Atoi(m.Subject()[i+1:])
			}
			km := toKafka(topic, p, m)
			out = append(out, km)
			seq = uint64(km.Offset)
		}
		if err := batch.Error(); err != nil {
			return nil, fmt.Errorf("natsbus: read %s: %w", topic, err)
		}
		if seq >= last || (n == 0 && ctx.Err() != nil) {
			return out, nil
		}
		if n == 0 {
			return nil, fmt.Errorf("natsbus: read %s: no message after sequence %d of %d", topic, seq, last)
		}
	}
}
