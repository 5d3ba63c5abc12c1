package saga

import (
	"testing"

	"github.com/sagaflow/sagaflow/internal/store"
)

func TestMachineRefuses(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		running, waiting, limit int
		want                    bool
	}{
		{0, 0, 1, false},
		{1, 0, 1, true},
		{2, 0, 3, false},
		{2, 1, 3, true}, // a start never overtakes a waiting saga
		{3, 0, 3, true},
		{4, 0, 3, true}, // above the limit after a resume
	} {
		if got := (machine{}).refuses(c.running, c.waiting, c.limit); got != c.want {
			t.Errorf("refuses(%d, %d, %d) = %v, want %v", c.running, c.waiting, c.limit, got, c.want)
		}
	}
}

// The public pause codes are the ones the store writes.
func TestPauseCodesMatchTheStore(t *testing.T) {
	if PauseCodeOperator != store.PauseCodeOperator || PauseCodeExhausted != store.PauseCodeExhausted {
		t.Fatalf("pause codes differ: %q/%q vs %q/%q", PauseCodeOperator, PauseCodeExhausted, store.PauseCodeOperator, store.PauseCodeExhausted)
	}
}
