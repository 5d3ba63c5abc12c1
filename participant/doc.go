// Package participant serves the commands that sagas in other services
// send to this service (saga steps with a Remote), and replies through the
// service's own outbox.
//
// # Handlers
//
// [Handle] registers a typed handler on a [Participant], command in, result
// out:
//
//	p, err := participant.New(pool, &participant.Config{Consumer: "payments"})
//	err = participant.Handle(p, "payments.charge", func(ctx context.Context, tx pgx.Tx, c participant.Call[Charge]) (Charged, error) {
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
// goes back to the saga as a steps.Reply, written to the service's outbox in the
// same transaction (run a relay on the service's schema to publish it). A
// permanent error is sent back as a refusal, and the handler's writes are
// undone; any other error leaves the command to be retried (an error of
// PostgreSQL refusing a value, a NUL byte in text say, fails the same way
// every time: the command is dead-lettered at once). The handler may open
// savepoints in tx (tx.Begin) but not end it: tx.Commit and tx.Rollback
// return an error, since the transaction is the consumer's and may carry
// other commands too.
//
// # Trust
//
// Anyone who can write to the command topic can send a participant a
// command. Before a command has any effect, the participant checks it, and
// dead-letters it, with no reply and nothing recorded, when:
//
//   - signing is on (Config.SigningKey) and its
//     sagaflow-signature header is missing or matches no accepted key
//     ([CodeUnverified]);
//   - its sagaflow-reply-to names a topic outside
//     Config.ReplyTopics, by default the reply topics of engines
//     with the default names, sagaflow.commands.<saga name>.replies
//     ([CodeReplyTopicRefused]);
//   - its step key is missing, malformed, not storable, or disagrees with
//     its saga id or direction header ([CodeNotASagaCommand]).
//
// With signing on, the replies are signed with the same key, so the saga's
// engine can refuse forged replies in turn:
//
//	p, err := participant.New(pool, &participant.Config{
//		Consumer:    "payments",
//		ReplyTopics: []string{"orders.replies"}, // the engine's KafkaConfig.ReplyTopic
//		SigningKey:  key,                        // shared by every engine and participant
//	})
//
// A compensation that arrives before its forward step's command (a relay
// retry reordered them, or the saga timed out waiting) closes the step: the
// forward is refused with [CodeCompensatedBeforeRun] and never runs. Only
// a compensation that is carried out closes it: one the handler refuses
// leaves the step open, so the forward may still run, and the compensation,
// sent again by the saga, then undoes it.
//
// A payload is decoded as encoding/json decodes it: a payload that is not
// JSON is refused with [CodeMalformedCommand], while invalid UTF-8 inside a
// JSON string becomes U+FFFD (the handler sees that character where the
// bytes were) and the command runs.
package participant
