package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
)

// broker is the Kafka a run talks to: an in-process kfake cluster (one
// broker on 127.0.0.1, records in memory), or KAFKA_BROKERS.
type broker struct {
	addrs []string
	kc    *kfake.Cluster
}

// startBroker starts kfake with the given topics, or, when KAFKA_BROKERS is
// set, creates the topics there.
func startBroker(ctx context.Context, partitions int, topics ...string) (*broker, error) {
	if env := os.Getenv("KAFKA_BROKERS"); env != "" {
		b := &broker{addrs: strings.Split(env, ",")}
		return b, b.createTopics(ctx, partitions, topics...)
	}
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(int32(partitions), topics...))
	if err != nil {
		return nil, fmt.Errorf("start kfake: %w", err)
	}
	return &broker{addrs: kc.ListenAddrs(), kc: kc}, nil
}

func (b *broker) kind() string {
	if b.kc != nil {
		return "kfake (in-process, 1 broker)"
	}
	return "KAFKA_BROKERS"
}

func (b *broker) createTopics(ctx context.Context, partitions int, topics ...string) error {
	conn, err := kafka.DialContext(ctx, "tcp", b.addrs[0])
	if err != nil {
		return fmt.Errorf("dial %s: %w", b.addrs[0], err)
	}
	defer conn.Close()
	ctl, err := conn.Controller()
	if err != nil {
		return fmt.Errorf("find the controller: %w", err)
	}
	cc, err := kafka.DialContext(ctx, "tcp", net.JoinHostPort(ctl.Host, strconv.Itoa(ctl.Port)))
	if err != nil {
		return fmt.Errorf("dial the controller: %w", err)
	}
	defer cc.Close()
	var cfgs []kafka.TopicConfig
	for _, t := range topics {
		cfgs = append(cfgs, kafka.TopicConfig{Topic: t, NumPartitions: partitions, ReplicationFactor: -1})
	}
	if err := cc.CreateTopics(cfgs...); err != nil {
		return fmt.Errorf("create topics: %w", err)
	}
	return nil
}

func (b *broker) close() {
	if b.kc != nil {
		b.kc.Close()
	}
}

// topicCounter reads how many records a topic holds: the sum of its
// partitions' end offsets.
type topicCounter struct {
	conns []*kafka.Conn
}

func newTopicCounter(ctx context.Context, addr, topic string, partitions int) (*topicCounter, error) {
	c := &topicCounter{}
	for p := range partitions {
		conn, err := kafka.DialLeader(ctx, "tcp", addr, topic, p)
		if err != nil {
			c.close()
			return nil, fmt.Errorf("dial %s/%d: %w", topic, p, err)
		}
		c.conns = append(c.conns, conn)
	}
	return c, nil
}

func (c *topicCounter) count() (int64, error) {
	var n int64
	for _, conn := range c.conns {
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		off, err := conn.ReadLastOffset()
		if err != nil {
			return 0, err
		}
		n += off
	}
	return n, nil
}

// waitFor polls until the topic holds want records, ctx ends or limit
// passes, and returns the count it saw last.
func (c *topicCounter) waitFor(ctx context.Context, want int64, limit time.Duration) (int64, error) {
	deadline := time.Now().Add(limit)
	for {
		n, err := c.count()
		if err != nil || n >= want || time.Now().After(deadline) {
			return n, err
		}
		if !sleepCtx(ctx, 5*time.Millisecond) {
			return n, ctx.Err()
		}
	}
}

func (c *topicCounter) close() {
	for _, conn := range c.conns {
		_ = conn.Close()
	}
}
