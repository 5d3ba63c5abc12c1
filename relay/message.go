package relay

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/store"
)

// The relay sets store.HeaderMessageID, store.HeaderType, store.HeaderSagaID
// and store.HeaderStepKey on every message from the row's columns. An entry
// of the row's headers column with one of these names is replaced by the
// column's value, so a consumer can trust them.

// Codes that start the last_error of a row the relay parked as dead, so
// tools can match the reason without parsing the text.
const (
	// CodeTooLarge: the message is larger than MaxMessageBytes, or the
	// broker refused it as too large.
	CodeTooLarge = "message_too_large"
	// CodeMalformedHeaders: the headers column is not a JSON object of
	// strings.
	CodeMalformedHeaders = "malformed_headers"
	// CodeInvalidTopic: the topic column is not a legal Kafka topic name,
	// or the broker refused it.
	CodeInvalidTopic = "invalid_topic"
	// CodeRejected: the broker refused the message for good.
	CodeRejected = "rejected"
	// CodeAttemptsExhausted: the row failed MaxAttempts publish attempts;
	// the text gives the last error.
	CodeAttemptsExhausted = "attempts_exhausted"
)

// maxReasonBytes bounds an error recorded as a row's last_error.
const maxReasonBytes = 2048

func reason(code, format string, args ...any) string {
	return truncate(code + ": " + fmt.Sprintf(format, args...))
}

func truncate(s string) string {
	if len(s) <= maxReasonBytes {
		return s
	}
	// Cut on a rune boundary.
	cut := maxReasonBytes
	for cut > 0 && s[cut]&0xC0 == 0x80 {
		cut--
	}
	return s[:cut] + "…"
}

// buildMessage turns a claimed row into a Kafka message. It returns a
// reason (with its code) when the row can never be published.
func buildMessage(row *store.RelayMessage, maxBytes int) (kafka.Message, string) {
	if !store.LegalTopic(row.Topic) {
		return kafka.Message{}, reason(CodeInvalidTopic,
			"topic %q is not a legal Kafka topic name (1 to 249 of a-z, A-Z, 0-9, '.', '_', '-')", row.Topic)
	}
	user, err := parseHeaders(row.Headers)
	if err != nil {
		return kafka.Message{}, reason(CodeMalformedHeaders, "headers must be a JSON object of strings: %v", err)
	}
	if i := slices.IndexFunc(user, func(h kafka.Header) bool { return h.Key == store.RawHeadersKey }); i >= 0 {
		return buildRaw(row, user, i, maxBytes)
	}
	headers := []kafka.Header{
		{Key: store.HeaderMessageID, Value: []byte(row.ID.String())},
		{Key: store.HeaderType, Value: []byte(row.Type)},
	}
	if row.SagaID != nil {
		headers = append(headers, kafka.Header{Key: store.HeaderSagaID, Value: []byte(row.SagaID.String())})
	}
	if row.StepKey != nil {
		headers = append(headers, kafka.Header{Key: store.HeaderStepKey, Value: []byte(*row.StepKey)})
	}
	own := len(headers)
	for _, h := range user {
		if slices.ContainsFunc(headers[:own], func(o kafka.Header) bool { return o.Key == h.Key }) {
			continue
		}
		headers = append(headers, h)
	}
	m := kafka.Message{
		Topic:   row.Topic,
		Key:     []byte(row.AggregateID),
		Value:   row.Payload,
		Headers: headers,
	}
	return checkSize(m, maxBytes)
}

func checkSize(m kafka.Message, maxBytes int) (kafka.Message, string) {
	if m.Value == nil {
		m.Value = []byte{}
	}
	if n := messageSize(&m); n > maxBytes {
		return kafka.Message{}, reason(CodeTooLarge,
			"message is %d bytes (key %d, payload %d, headers and framing the rest), over MaxMessageBytes (%d)",
			n, len(m.Key), len(m.Value), maxBytes)
	}
	return m, ""
}

// buildRaw builds the message of a row whose headers column carries another
// producer's headers under store.RawHeadersKey (a requeued dead letter):
// they are sent exactly as they are, and the relay adds none of its own, so
// the message keeps its original sagaflow-message-id. An empty aggregateid
// is sent as no key.
func buildRaw(row *store.RelayMessage, user []kafka.Header, i, maxBytes int) (kafka.Message, string) {
	if len(user) != 1 {
		return kafka.Message{}, reason(CodeMalformedHeaders, "%s must be the only entry of the headers, not one of %d",
			store.RawHeadersKey, len(user))
	}
	raw, err := store.DecodeRawHeaders(string(user[i].Value))
	if err != nil {
		return kafka.Message{}, reason(CodeMalformedHeaders, "%s: %v", store.RawHeadersKey, err)
	}
	m := kafka.Message{Topic: row.Topic, Value: row.Payload}
	if row.AggregateID != "" {
		m.Key = []byte(row.AggregateID)
	}
	if len(raw) > 0 {
		m.Headers = make([]kafka.Header, len(raw))
		for j, h := range raw {
			m.Headers[j] = kafka.Header{Key: string(h.Key), Value: h.Value}
		}
	}
	return checkSize(m, maxBytes)
}

// parseHeaders decodes a JSON object of strings into headers sorted by name.
func parseHeaders(raw []byte) ([]kafka.Header, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || raw[0] != '{' {
		kind := "empty"
		if len(raw) > 0 {
			kind = jsonKind(raw[0])
		}
		return nil, fmt.Errorf("got %s", kind)
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(raw, &obj); err != nil {
		return nil, err
	}
	names := make([]string, 0, len(obj))
	for k := range obj {
		names = append(names, k)
	}
	slices.Sort(names)
	out := make([]kafka.Header, 0, len(names))
	for _, k := range names {
		v := bytes.TrimSpace(obj[k])
		var s string
		if len(v) == 0 {
			return nil, fmt.Errorf("header %q has no value", k)
		}
		if v[0] != '"' {
			return nil, fmt.Errorf("header %q is %s, not a string", k, jsonKind(v[0]))
		}
		if err := json.Unmarshal(v, &s); err != nil {
			return nil, fmt.Errorf("header %q: %w", k, err)
		}
		out = append(out, kafka.Header{Key: k, Value: []byte(s)})
	}
	return out, nil
}

func jsonKind(first byte) string {
	switch first {
	case '{':
		return "an object"
	case '[':
		return "an array"
	case '"':
		return "a string"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	default:
		return "a number"
	}
}

// messageSize is an upper bound of the bytes a message takes in a record
// batch: kafka-go refuses a message larger than its writer's BatchBytes by
// the same measure, give or take a few bytes of varint framing.
func messageSize(m *kafka.Message) int {
	n := 22 + len(m.Key) + len(m.Value) + 5
	for _, h := range m.Headers {
		n += 10 + len(h.Key) + len(h.Value)
	}
	return n
}

// topicsOf lists the distinct topics of msgs, in order of appearance.
func topicsOf(msgs []kafka.Message) []string {
	var out []string
	for i := range msgs {
		if !slices.Contains(out, msgs[i].Topic) {
			out = append(out, msgs[i].Topic)
		}
	}
	return out
}

func joinTopics(msgs []kafka.Message) string {
	ts := topicsOf(msgs)
	if len(ts) > 5 {
		return strings.Join(ts[:5], ",") + fmt.Sprintf(",… (%d topics)", len(ts))
	}
	return strings.Join(ts, ",")
}
