package natsbus

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// streamPrefix starts the name of every stream this package creates, so
// that sagaflow's streams stand apart from the others on the server.
const streamPrefix = "sagaflow_"

// maxNameBytes bounds a stream or consumer name: the server stores each
// under a directory of that name.
const maxNameBytes = 200

// StreamName returns the name of the stream that holds topic's messages:
// "sagaflow_" and the topic, each byte outside [A-Za-z0-9-] written as "_"
// and two hex digits ("orders.events" → "sagaflow_orders_2eevents"). A
// name longer than 200 bytes is cut to its first 182, followed by "_h" and
// the first 16 hex digits of the SHA-256 of the whole name. Two topics never
// share a stream.
func StreamName(topic string) string { return bounded(streamPrefix + escape(topic)) }

// ConsumerName returns the name of group's durable consumer of one
// partition: the group escaped (and, when long, cut) as in [StreamName],
// "_p" and the partition.
func ConsumerName(group string, partition int) string {
	return bounded(escape(group)) + "_p" + strconv.Itoa(partition)
}

// Subject returns the subject of a topic's partition: the topic, a dot and
// the partition number ("orders.events.3").
func Subject(topic string, partition int) string { return topic + "." + strconv.Itoa(partition) }

// escape keeps [A-Za-z0-9-] and writes every other byte as "_" and two
// lowercase hex digits. The result never holds "_" followed by a byte that
// is not a hex digit, so a suffix such as "_p3" or "_h…" cannot be part of
// an escaped name.
func escape(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' {
			b.WriteByte(c)
			continue
		}
		fmt.Fprintf(&b, "_%02x", c)
	}
	return b.String()
}

// bounded shortens a name longer than maxNameBytes to its first bytes,
// "_h" and 16 hex digits of its SHA-256.
func bounded(name string) string {
	if len(name) <= maxNameBytes {
		return name
	}
	sum := sha256.Sum256([]byte(name))
	return name[:maxNameBytes-18] + "_h" + hex.EncodeToString(sum[:8])
}

// TopicMaxBytes is the longest topic: with its stream's description it
// stays within what the server takes (4096 bytes).
const TopicMaxBytes = 1024

// groupDescribed is how much of a group a consumer's description shows
// (the server takes 4096 bytes): its name carries the whole group, escaped
// and bounded (see [ConsumerName]).
const groupDescribed = 1024

// subjectProblem says why topic cannot be a subject's first tokens, or "".
func subjectProblem(topic string) string {
	if topic == "" {
		return "is empty"
	}
	if len(topic) > TopicMaxBytes {
		return fmt.Sprintf("is longer than TopicMaxBytes (%d bytes)", TopicMaxBytes)
	}
	if !utf8.ValidString(topic) {
		return "is not valid UTF-8 (the server would store another subject)"
	}
	for i := 0; i < len(topic); i++ {
		switch c := topic[i]; {
		case c <= ' ' || c == 0x7f:
			return "holds a space or a control character"
		case c == '*' || c == '>':
			return "holds a NATS wildcard ('*' or '>')"
		}
	}
	for _, tok := range strings.Split(topic, ".") {
		if tok == "" {
			return "has an empty token (a leading, trailing or doubled '.')"
		}
	}
	return ""
}

// partitionsOf returns how many partitions a stream with these subjects
// has: they must be topic.0 … topic.n-1, in order, as [Setup] makes them.
func partitionsOf(topic string, subjects []string) (int, error) {
	if len(subjects) == 0 {
		return 0, fmt.Errorf("stream %s has no subjects", StreamName(topic))
	}
	for i, s := range subjects {
		if s != Subject(topic, i) {
			return 0, fmt.Errorf("stream %s has subject %q where %q was expected: create it with natsbus.Setup",
				StreamName(topic), s, Subject(topic, i))
		}
	}
	return len(subjects), nil
}
