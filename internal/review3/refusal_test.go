package review3_test

import (
	"strings"
	"sync/atomic"
	"testing"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/sagatest"
	"github.com/sagaflow/sagaflow/wire"
)

// protocol.md "Replies": "The engine never refuses a refusal for its text: a
// NUL byte becomes \0, invalid UTF-8 becomes U+FFFD, and the text and code
// are cut to their limits before they are stored", and "the engine uses
// refused when it is empty". A refusal is final: the saga compensates.
func TestEngineRefusalText(t *testing.T) {
	pool, schema := migrated(t)
	kc := kafkatest.New(t, kafkatest.SeedTopics(1, svcTopic, rvReplies, rvCommandTopc))
	var applied atomic.Int64
	e, def := remoteEngine(t, kc, pool, schema, nil, &applied)
	cmds := collect(t, kc, svcTopic)
	prod := producer(t, kc)

	// A NUL, invalid UTF-8 and 10 kB of text and code.
	id, key := startAndAwaitCommand(t, e, def, cmds, "o-1")
	body := `{"ok":false,"error":"nul\u0000 bad` + "\xff" + ` ` + strings.Repeat("e", 10240) + `","code":"c\u0000` + strings.Repeat("c", 10240) + `"}`
	send(t, prod, rvReplies, id, reply(id, key), []byte(body))
	in := sagatest.WaitEnded(t, e, uuid.MustParse(id), nil)
	require.NotEqual(t, saga.Status("completed"), in.Status, sagatest.Describe(in))
	require.NotNil(t, in.LastError, sagatest.Describe(in))
	require.True(t, utf8.ValidString(in.LastError.Message))
	require.NotContains(t, in.LastError.Message, "\x00")
	require.NotContains(t, in.LastError.Code, "\x00")
	require.Contains(t, in.LastError.Message, `nul\0 bad`+"\uFFFD")
	// Was a finding: the engine kept 4,000 bytes of text and 200 of code
	// plus the mark. Both are now cut to the protocol's limits, on a
	// character boundary, and marked with "…", as the doc says.
	require.LessOrEqual(t, len(in.LastError.Message), wire.MaxReplyErrorBytes+len("…"))
	require.True(t, strings.HasSuffix(in.LastError.Message, "…"))
	require.LessOrEqual(t, len(in.LastError.Code), wire.MaxReplyCodeBytes+len("…"))
	require.True(t, strings.HasSuffix(in.LastError.Code, "…"))

	// No code: "refused".
	id2, key2 := startAndAwaitCommand(t, e, def, cmds, "o-2")
	send(t, prod, rvReplies, id2, reply(id2, key2), []byte(`{"ok":false,"error":"no"}`))
	in = sagatest.WaitEnded(t, e, uuid.MustParse(id2), nil)
	require.NotNil(t, in.LastError, sagatest.Describe(in))
	require.Equal(t, "refused", in.LastError.Code, sagatest.Describe(in))

	// A reply whose payload does not decode ("ok" not a boolean): the doc's
	// malformed-input table does not list it. It must not complete the step,
	// and must not be lost.
	id3, key3 := startAndAwaitCommand(t, e, def, cmds, "o-3")
	send(t, prod, rvReplies, id3, reply(id3, key3), []byte(`{"ok":"yes","result":{"charge_id":"x"}}`))
	send(t, prod, rvReplies, id3, reply(id3, key3), []byte(`{"ok":true,"result":{"charge_id":"ch_3"}}`))
	in = sagatest.WaitEnded(t, e, uuid.MustParse(id3), nil)
	t.Logf("after a reply that does not decode and a good one: %s", sagatest.Describe(in))
	var reasons []string
	for _, l := range deadLetters(t, e) {
		reasons = append(reasons, l.Reason)
	}
	require.Equal(t, saga.Status("completed"), in.Status, "the good reply behind the undecodable one completed the step")
	require.Len(t, reasons, 1, "the undecodable reply is dead-lettered, not lost")
	require.Contains(t, reasons[0], "malformed")
}
