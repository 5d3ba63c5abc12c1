package steps_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/sagaflow/sagaflow/steps"
)

// Errors say how a step failed: retry later, give up, and why.
func ExamplePermanent() {
	declined := steps.Permanent(steps.WithCode("card_declined", errors.New("the card was declined")))
	busy := steps.RetryAfter(30*time.Second, errors.New("the provider answered 429"))
	for _, err := range []error{declined, busy} {
		var delay time.Duration
		if retry := (*steps.RetryAfterError)(nil); errors.As(err, &retry) {
			delay = retry.Delay
		}
		fmt.Printf("%v\n  permanent %t, code %q, retry after %v\n", err, steps.IsPermanent(err), steps.Code(err), delay)
	}
	// Output:
	// permanent: card_declined: the card was declined
	//   permanent true, code "card_declined", retry after 0s
	// retry after 30s: the provider answered 429
	//   permanent false, code "", retry after 30s
}
