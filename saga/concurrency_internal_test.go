package saga

import "testing"

func TestMachineAdmit(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		running, limit int
		noWait         bool
		want           admission
	}{
		{0, 1, false, admitRun},
		{0, 1, true, admitRun},
		{1, 1, false, admitQueue},
		{1, 1, true, admitRefuse},
		{2, 3, false, admitRun},
		{3, 3, false, admitQueue},
		{4, 3, false, admitQueue}, // above the limit after a resume
		{4, 3, true, admitRefuse},
	} {
		if got := (machine{}).admit(c.running, c.limit, c.noWait); got != c.want {
			t.Errorf("admit(%d, %d, %v) = %v, want %v", c.running, c.limit, c.noWait, got, c.want)
		}
	}
}
