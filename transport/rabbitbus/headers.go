package rabbitbus

import (
	"fmt"
	"slices"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/wire"
)

// KeyHeader carries a message's key in its AMQP headers (AMQP has no key
// field). It is absent for a message without a key. A [Reader] moves it
// back to kafka.Message.Key and does not show it as a header; a [Writer]
// refuses a message that carries a header of that name itself.
const KeyHeader = "x-sagaflow-key"

// toTable converts Kafka headers to an AMQP table, with the key under
// KeyHeader. Values are kept as bytes. A name that occurs more than once
// becomes an array of its values, in order. It returns why a message cannot
// be carried.
func toTable(key []byte, headers []kafka.Header) (amqp.Table, error) {
	t := make(amqp.Table, len(headers)+1)
	for _, h := range headers {
		switch {
		case h.Key == KeyHeader:
			return nil, fmt.Errorf("header %q is reserved by the RabbitMQ transport for the message key", KeyHeader)
		case len(h.Key) > maxShortString:
			return nil, fmt.Errorf("a header name is %d bytes, more than AMQP's %d", len(h.Key), maxShortString)
		}
		v := slices.Clone(h.Value)
		if v == nil {
			v = []byte{}
		}
		switch old := t[h.Key].(type) {
		case nil:
			t[h.Key] = v
		case []byte:
			t[h.Key] = []any{old, v}
		case []any:
			t[h.Key] = append(old, v)
		}
	}
	if key != nil {
		t[KeyHeader] = slices.Clone(key)
	}
	return t, nil
}

// tableSize is an upper bound of the bytes t takes on the wire (a field
// table as toTable builds it).
func tableSize(t amqp.Table) int {
	n := 4
	for k, v := range t {
		n += 1 + len(k) + fieldSize(v)
	}
	return n
}

func fieldSize(v any) int {
	switch v := v.(type) {
	case []byte:
		return 1 + 4 + len(v)
	case string:
		return 1 + 4 + len(v)
	case []any:
		n := 1 + 4
		for _, e := range v {
			n += fieldSize(e)
		}
		return n
	default:
		return 1 + 8
	}
}

// fromTable converts an AMQP table to Kafka headers and the key. Headers are
// sorted by name (an AMQP table has no order), a name given an array
// repeats once per element, in order. Values that are not bytes (set by
// another producer or by the broker, such as a quorum queue's
// x-delivery-count) become their text.
func fromTable(t amqp.Table) (key []byte, headers []kafka.Header) {
	names := make([]string, 0, len(t))
	for k := range t {
		names = append(names, k)
	}
	slices.Sort(names)
	headers = make([]kafka.Header, 0, len(names))
	for _, k := range names {
		v := t[k]
		if k == KeyHeader {
			key = fieldBytes(v)
			if key == nil {
				key = []byte{}
			}
			continue
		}
		if arr, ok := v.([]any); ok {
			for _, e := range arr {
				headers = append(headers, kafka.Header{Key: k, Value: fieldBytes(e)})
			}
			continue
		}
		headers = append(headers, kafka.Header{Key: k, Value: fieldBytes(v)})
	}
	return key, headers
}

// fieldBytes is a table value as bytes: bytes and strings as they are,
// numbers in decimal, times in RFC 3339, other values as Go formats them.
func fieldBytes(v any) []byte {
	switch v := v.(type) {
	case nil:
		return []byte{}
	case []byte:
		return v
	case string:
		return []byte(v)
	case bool:
		return strconv.AppendBool(nil, v)
	case int8, int16, int32, int64, int, uint8, uint16, uint32, uint64:
		return fmt.Appendf(nil, "%d", v)
	case float32:
		return strconv.AppendFloat(nil, float64(v), 'g', -1, 32)
	case float64:
		return strconv.AppendFloat(nil, v, 'g', -1, 64)
	case time.Time:
		return []byte(v.UTC().Format(time.RFC3339))
	default:
		return fmt.Appendf(nil, "%v", v)
	}
}

// messageID is the sagaflow-message-id header's last value, or "".
func messageID(headers []kafka.Header) string {
	for i := len(headers) - 1; i >= 0; i-- {
		if headers[i].Key == wire.HeaderMessageID {
			return string(headers[i].Value)
		}
	}
	return ""
}
