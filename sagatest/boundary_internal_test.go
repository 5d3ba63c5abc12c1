package sagatest

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/internal/fault"
)

// The public boundary names are the engine's fault points, which the
// matrix hooks by name.
func TestBoundariesAreTheEnginesFaultPoints(t *testing.T) {
	for b, point := range map[Boundary]string{
		AfterClaim:   fault.EngineAfterClaim,
		AfterHandler: fault.EngineAfterHandler,
		BeforeCommit: fault.EngineBeforeCommit,
		AfterCommit:  fault.EngineAfterCommit,
		AfterHold:    fault.EngineAfterHold,
	} {
		require.Equal(t, point, string(b))
	}
}
