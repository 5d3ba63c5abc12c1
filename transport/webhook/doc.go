// Package webhook publishes outbox messages to HTTP endpoints, and verifies
// them on the receiving side.
//
// A [Publisher] is a relay writer (give it to relay.New): each message of an
// outbox topic listed in Config.URLs is POSTed to its URL, the body being
// the message's payload. The request carries:
//
//   - Content-Type: Config.ContentType (application/json by default);
//   - Idempotency-Key: the message id (the sagaflow-message-id header), the
//     same for every retry of the message: receivers deduplicate by it;
//   - Sagaflow-Key: the message's key (its outbox row's aggregateid), when
//     HTTP can carry it as it is; an empty key, or one with a control
//     character, blanks at either end or more than MaxHeaderValueBytes, is
//     left out (the message is still sent);
//   - "Sagaflow-" + name: each of the message's headers, its name prefixed
//     as it is (HTTP names are case-insensitive: sagaflow-type arrives as
//     Sagaflow-Sagaflow-Type, traceparent as Sagaflow-Traceparent);
//   - Webhook-Timestamp: the attempt's time, Unix seconds;
//   - Webhook-Signature: "v1=" followed by the lower-case hex of
//     HMAC-SHA256(key, timestamp + "." + idempotencyKey + "." + body), one
//     entry per signing key, separated by ", ". The timestamp is the
//     Webhook-Timestamp value as sent, idempotencyKey the Idempotency-Key
//     value (it holds no '.'), the body the raw bytes. Signing the key means
//     a captured request cannot be replayed under a new key past the
//     receiver's deduplication. Keys are at least 16 bytes, on both sides.
//
// A receiver in any language recomputes the HMAC of timestamp "."
// idempotencyKey "." body with its key, compares it in constant time with
// each v1= entry, and refuses a timestamp too far from its clock (a
// replay). [Verify] and [Handler] do so in Go. Signing with two keys while
// receivers move from the old to the new one rotates keys without refusing
// anything. A receiver given a key shorter than 16 bytes refuses every
// request (as a signature that does not match, naming the short key): it
// fails closed on its own misconfiguration.
//
// What an answer means for the outbox row (package relay's rules):
//
//   - 2xx: published;
//   - 408, 429, 5xx, a timeout or a connection cut mid-request: retried,
//     spending an attempt, after the relay's Backoff; the row is parked as
//     dead (attempts_exhausted) once its MaxAttempts are spent;
//   - any other 4xx: the endpoint refused this message for good: the row is
//     parked as dead at once with code http_<status> and, in its error, the
//     status and the first MaxResponseBytes of the response's body;
//   - 3xx: redirects are not followed (a redirected POST may go on as a GET
//     without its body): parked as dead at once, http_<status>, with the
//     Location in its error;
//   - no connection at all (refused, DNS): an outage: the row waits without
//     spending an attempt, however long the endpoint is down;
//   - a topic without a URL, or a header HTTP cannot carry as it is: parked
//     as dead at once (no_webhook_url, bad_header). A header cannot travel
//     as it is when its name is not an HTTP token, its value holds a control
//     character or invalid UTF-8, starts or ends with a blank (which HTTP
//     drops) or has more than MaxHeaderValueBytes, or its prefixed name
//     matches, ignoring case, Sagaflow-Key or another header of the message
//     (it would replace it).
//
// A relay publishes every topic of its outbox, so a topic that should go to
// Kafka, or to another publisher's URLs, must not share the webhook relay's
// schema: its rows would be parked as no_webhook_url.
//
// Messages of one key are sent one after the other, in order, and a failure
// holds the key's later messages of the batch back for the next try: they
// are not sent, spend no attempt and are not parked with it
// (relay.PublishError's NotSent), and are due again with the failed one, or
// at once when it was parked. Messages of different keys go at once, at
// most Config.Concurrency. Retry-After is not honoured: the relay's Backoff
// spaces the retries.
package webhook
