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
//
// # Participants
//
// A [Participant] serves the commands that sagas in other services send to
// this service (saga steps with a Remote). [Handle] registers a typed
// handler, command in, result out:
//
//	p, err := steps.NewParticipant(pool, &steps.ParticipantConfig{Consumer: "payments"})
//	err = steps.Handle(p, "payments.charge", func(ctx context.Context, tx pgx.Tx, c steps.Call[Charge]) (Charged, error) {
//		id, err := provider.Charge(ctx, c.Command.Amount, c.Key.String()) // the step key as idempotency key
//		if errors.Is(err, provider.ErrDeclined) {
//			return Charged{}, steps.Permanent(steps.WithCode("card_declined", err)) // the saga compensates
//		}
//		return Charged{ID: id}, err
//	})
//	consumer, err := p.Inbox().NewConsumer(kafkaReader, &inbox.ConsumerConfig{Handlers: p.Handlers()})
//
// The handler runs in the service's own transaction, which records the
// step-scoped key first, so a command delivered twice runs once; its result
// goes back to the saga as a [Reply] written to the service's outbox in the
// same transaction (run a relay on the service's schema to publish it). A
// permanent error is sent back as a refusal, and the handler's writes are
// undone; any other error leaves the command to be retried (an error of
// PostgreSQL refusing a value, a NUL byte in text say, fails the same way
// every time: the command is dead-lettered at once).
//
// # Trust
//
// Anyone who can write to the command topic can send a participant a
// command. Before a command has any effect, the participant checks it, and
// dead-letters it, with no reply and nothing recorded, when:
//
//   - signing is on (ParticipantConfig.SigningKey) and its
//     sagaflow-signature header is missing or matches no accepted key
//     ([CodeUnverified]);
//   - its sagaflow-reply-to names a topic outside
//     ParticipantConfig.ReplyTopics, by default the reply topics of engines
//     with the default names, sagaflow.commands.<saga name>.replies
//     ([CodeReplyTopicRefused]);
//   - its step key is missing, malformed, not storable, or disagrees with
//     its saga id or direction header ([CodeNotASagaCommand]).
//
// With signing on, the replies are signed with the same key, so the saga's
// engine can refuse forged replies in turn:
//
//	p, err := steps.NewParticipant(pool, &steps.ParticipantConfig{
//		Consumer:    "payments",
//		ReplyTopics: []string{"orders.replies"}, // the engine's KafkaConfig.ReplyTopic
//		SigningKey:  key,                        // shared by every engine and participant
//	})
//
// A compensation that arrives before its forward step's command (a relay
// retry reordered them, or the saga timed out waiting) closes the step: the
// forward is refused with [CodeCompensatedBeforeRun] and never runs.
package steps
