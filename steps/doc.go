// Package steps is the vocabulary a saga step and a saga participant share:
// the step-scoped idempotency [Key], the outcome helpers a handler returns
// to steer retries, and the [Reply] a participant sends back. The wire
// format itself (headers, the key's canonical form, the envelopes) belongs
// to package wire; the participant runtime is package participant.
//
// # Step-scoped keys
//
// Every execution of a saga step carries a [Key] of the form
//
//	<saga id>/<step name>/<direction>/<epoch>
//
// for example 0193a0f4-.../charge/forward/0 (wire.Key is its canonical
// form, written in Go only). The key is the same for every
// attempt and every duplicate delivery of that step, and changes only when an
// operator re-runs the step under a new epoch. sagaflow records it in the
// inbox in the transaction that commits the step, so a duplicate has no
// second effect inside PostgreSQL; handlers pass it to external services as
// their idempotency key (an Idempotency-Key header, say), which is the only
// honest way to make an external side effect happen once.
//
// # Outcomes
//
// A handler returns nil on success. Any other error is retried with the step's
// retry policy, except:
//
//   - [Permanent](err): do not retry; the saga compensates (or, for a
//     compensation, fails and is parked for an operator);
//   - [RetryAfter](d, err): retry, but not sooner than d;
//   - [WithCode](code, err): attach a stable code that is stored with the
//     error, so dashboards and bulk replay can match it after a restart.
//
// The helpers compose: Permanent(WithCode("card_declined", err)).
package steps
