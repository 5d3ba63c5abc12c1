package steps_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/steps"
)

func TestKeyRoundTrip(t *testing.T) {
	t.Parallel()
	k := steps.Key{SagaID: uuid.New(), Step: "charge", Direction: steps.Compensate, Epoch: 3}
	got, err := steps.ParseKey(k.String())
	require.NoError(t, err)
	require.Equal(t, k, got)
	require.Equal(t, k.SagaID.String()+"/charge/compensate/3", k.String())
}

func TestParseKeyRejectsMalformedKeys(t *testing.T) {
	t.Parallel()
	id := uuid.NewString()
	for _, tc := range []struct{ in, want string }{
		{"", "want saga_id/step/direction/epoch"},
		{id + "/a/forward", "want saga_id/step/direction/epoch"},
		{"nope/a/forward/0", "saga id"},
		{id + "//forward/0", "empty step name"},
		{id + "/a/sideways/0", `direction "sideways"`},
		{id + "/a/forward/-1", `epoch "-1"`},
		{id + "/a/forward/x", `epoch "x"`},
	} {
		_, err := steps.ParseKey(tc.in)
		require.ErrorContains(t, err, tc.want, "input %q", tc.in)
	}
}

func FuzzParseKey(f *testing.F) {
	f.Add(uuid.NewString() + "/charge/forward/0")
	f.Add("a/b/c/d")
	f.Fuzz(func(t *testing.T, s string) {
		k, err := steps.ParseKey(s)
		if err != nil {
			return
		}
		again, err := steps.ParseKey(k.String())
		require.NoError(t, err)
		require.Equal(t, k, again)
	})
}

func TestOutcomesCompose(t *testing.T) {
	t.Parallel()
	base := errors.New("card declined")
	err := fmt.Errorf("charge: %w", steps.Permanent(steps.WithCode("card_declined", base)))
	require.True(t, steps.IsPermanent(err))
	require.Equal(t, "card_declined", steps.Code(err))
	require.ErrorIs(t, err, base)
	require.Equal(t, "charge: permanent: card_declined: card declined", err.Error())

	r := steps.RetryAfter(2*time.Second, base)
	var ra *steps.RetryAfterError
	require.ErrorAs(t, r, &ra)
	require.Equal(t, 2*time.Second, ra.Delay)
	require.False(t, steps.IsPermanent(r))
	require.Equal(t, "", steps.Code(r))

	require.Error(t, steps.Permanent(nil), "a nil error still fails the step")
	require.Equal(t, time.Duration(0), steps.RetryAfter(-time.Second, nil).(*steps.RetryAfterError).Delay)
	require.Equal(t, "x", steps.Code(steps.WithCode("x", nil)))
}
