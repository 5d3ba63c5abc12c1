package saga

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
)

// The public statuses are the strings the store writes.
func TestStatusesMatchTheStore(t *testing.T) {
	for pub, st := range map[Status]string{
		StatusRunning:      store.StatusRunning,
		StatusCompensating: store.StatusCompensating,
		StatusCompleted:    store.StatusCompleted,
		StatusCompensated:  store.StatusCompensated,
		StatusFailed:       store.StatusFailed,
	} {
		require.Equal(t, st, string(pub))
	}
}
