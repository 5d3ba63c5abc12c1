// Package steps holds what a saga step and a saga participant have in common:
// the step-scoped idempotency [Key] and the outcome helpers a handler returns
// to steer retries.
//
// # Step-scoped keys
//
// Every execution of a saga step carries a [Key] of the form
//
//	<saga id>/<step name>/<direction>/<epoch>
//
// for example 0193a0f4-.../charge/forward/0. The key is the same for every
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
