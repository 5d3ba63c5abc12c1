package saga

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/store"
)

// Two batches can hold one saga at once: the one that committed its step
// and has not returned yet, and the one that claimed the next command. The
// first one's release must leave the second one's step where a cancel
// request finds it (it used to drop it, and the request never arrived).
func TestRunningStepsSurvivesAnOverlappingRelease(t *testing.T) {
	var r runningSteps
	id := uuid.New()
	r.claim(id) // batch A, which ran step 1
	r.claim(id) // batch B, which claimed step 2 before A returned
	ctx, cancel := context.WithCancelCause(context.Background())
	r.start(id, cancel) // B's handler runs
	r.release(id)       // A returns
	require.Equal(t, []uuid.UUID{id}, r.ids(), "B still holds the saga")
	require.True(t, r.heard(id, store.CancelRequest{Reason: "stop", Epoch: 0}), "the running step is told")
	require.Error(t, context.Cause(ctx))
	var cr *cancelRequested
	require.ErrorAs(t, context.Cause(ctx), &cr)
	require.Equal(t, "stop", cr.reason)
	r.stop(id)
	r.release(id) // B returns
	require.Empty(t, r.ids())
	require.False(t, r.has(id))
	r.release(id) // a release with no claim left changes nothing
	require.Empty(t, r.ids())
}
