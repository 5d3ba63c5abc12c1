package saga

import (
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
)

// carryInto keeps everything the first transition writes besides its own
// update: a fold that dropped any of it would lose a history entry, a step
// key (a duplicate would run twice), a pending command's delete or a
// signal's delivery.
func TestCarryInto(t *testing.T) {
	wake, cmd := uuid.New(), uuid.New()
	first := &store.Transition{History: []store.HistoryEntry{{Event: "signal_received"}, {Event: "step_completed"}},
		State: []byte(`{"a":1}`), InboxKey: "k/picked", EarlierInboxKeys: []string{"k/pay"}, Supersede: []uuid.UUID{wake},
		DeliverSignal: 7, DeliverStep: "picked"}
	tr := &store.Transition{History: []store.HistoryEntry{{Event: "step_completed"}}, InboxKey: "k/ship",
		Supersede: []uuid.UUID{cmd}}
	carryInto(tr, first)
	require.Equal(t, []string{"signal_received", "step_completed", "step_completed"},
		[]string{tr.History[0].Event, tr.History[1].Event, tr.History[2].Event})
	require.Equal(t, `{"a":1}`, string(tr.State), "first's state, as tr sets none")
	require.Equal(t, "k/ship", tr.InboxKey)
	require.Equal(t, []string{"k/pay", "k/picked"}, tr.EarlierInboxKeys)
	require.Equal(t, []uuid.UUID{wake, cmd}, tr.Supersede)
	require.Equal(t, int64(7), tr.DeliverSignal)
	require.Equal(t, "picked", tr.DeliverStep)

	own := &store.Transition{State: []byte(`{"b":2}`)}
	carryInto(own, &store.Transition{State: []byte(`{"a":1}`)})
	require.Equal(t, `{"b":2}`, string(own.State), "tr's own state wins")
	require.Zero(t, own.DeliverSignal)
}
