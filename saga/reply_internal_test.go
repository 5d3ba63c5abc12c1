package saga

import (
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// A refusal is matched to the command the saga waits for by the id it
// names; one that names none, or a saga that records none, cannot be told
// apart and is applied as before.
func TestAnswersAnother(t *testing.T) {
	t.Parallel()
	waits := uuid.Must(uuid.NewV7())
	other := uuid.Must(uuid.NewV7())
	for _, tc := range []struct {
		inReplyTo string
		commandID *uuid.UUID
		want      bool
	}{
		{"", &waits, false},
		{waits.String(), nil, false},
		{waits.String(), &waits, false},
		{strings.ToUpper(waits.String()), &waits, false},
		{other.String(), &waits, true},
		{"not-a-command-id", &waits, true},
		{"\x00\xff", &waits, true},
	} {
		require.Equal(t, tc.want, answersAnother(tc.inReplyTo, tc.commandID), "%q against %v", tc.inReplyTo, tc.commandID)
	}
}
