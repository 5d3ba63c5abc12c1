package store_test

import (
	"context"
	"encoding/base64"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
)

// Every text field of a dead letter may hold bytes PostgreSQL refuses; the
// insert must still succeed, keep the raw bytes, and store one row per
// Kafka position however often it is called.
func TestInsertDeadLetterCannotFailOnContent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, st, schema := newStore(t)

	long := strings.Repeat("x", 10_000)
	for i, poison := range []string{"a\x00b", "a\xff\xfeb", long} {
		p, o := 0, int64(i)
		d := &store.DeadLetter{
			Consumer: "c" + poison, MessageID: poison, Topic: "t", Partition: &p, Offset: &o,
			Key: []byte(poison), Value: []byte(poison),
			Headers:    map[string]string{poison: poison, "plain": poison},
			RawHeaders: []store.RawHeader{{Key: []byte(poison), Value: []byte(poison)}, {Key: []byte(poison), Value: nil}},
			Reason:     poison,
		}
		require.NoError(t, st.InsertDeadLetter(ctx, pool, d), "poison %d", i)
		require.NoError(t, st.InsertDeadLetter(ctx, pool, d), "poison %d again", i)

		var n int
		var key, value []byte
		var raw []map[string]string
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) OVER (), msg_key, msg_value, raw_headers FROM "`+schema+`".dead_letters
			WHERE kafka_offset = $1`, o).Scan(&n, &key, &value, &raw))
		require.Equal(t, 1, n, "one row per position")
		require.Equal(t, []byte(poison), key)
		require.Equal(t, []byte(poison), value)
		require.Len(t, raw, 2)
		name, err := base64.StdEncoding.DecodeString(raw[0]["k"])
		require.NoError(t, err)
		require.Equal(t, []byte(poison), name)
	}
}
