package relay

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestFinishedIn(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		xid  uint32
		snap string
		want bool
	}{
		{"below xmin", 5, "10:20:", true},
		{"between, not running", 15, "10:20:", true},
		{"between, running", 15, "10:20:12,15", false},
		{"between, another running", 16, "10:20:12,15", true},
		{"at xmax: committed in the WAL, not yet visible", 764, "764:764:", false},
		{"above xmax", 770, "764:764:", false},
		{"just below xmax", 764, "765:765:", true},
		{"previous epoch, running", 4294967295, "4294967290:4294967301:4294967295", false},
		{"previous epoch, finished", 4294967294, "4294967290:4294967301:4294967295", true},
		{"this epoch, running", 3, "4294967290:4294967301:4294967299", false},
		{"this epoch, at xmax", 5, "4294967290:4294967301:", false},
		{"this epoch, finished", 2, "4294967290:4294967301:4294967299", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got, err := finishedIn(tc.xid, tc.snap)
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
	for _, snap := range []string{"", "10:20", "a:20:", "10:b:", "10:20:x"} {
		_, err := finishedIn(15, snap)
		require.Error(t, err, "snapshot %q", snap)
	}
}
