package webhook

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/wire"
)

// Headers of a webhook request.
const (
	// HeaderIdempotencyKey carries the message id (sagaflow-message-id):
	// the same for every retry of one message, so the receiver can
	// deduplicate.
	HeaderIdempotencyKey = "Idempotency-Key"
	// HeaderTimestamp is the time of the attempt, in Unix seconds.
	HeaderTimestamp = "Webhook-Timestamp"
	// HeaderSignature is "v1=<hex>", one per signing key, comma-separated:
	// hex(HMAC-SHA256(key, timestamp + "." + Idempotency-Key + "." + body)).
	HeaderSignature = "Webhook-Signature"
	// HeaderKey carries the message's key (the outbox row's aggregateid),
	// when it has one HTTP can carry.
	HeaderKey = "Sagaflow-Key"
	// HeaderPrefix prefixes the message's own headers, whose names keep
	// their own prefix: sagaflow-type travels as Sagaflow-Sagaflow-Type,
	// traceparent as Sagaflow-Traceparent.
	HeaderPrefix = "Sagaflow-"
)

// Defaults of a [Publisher].
const (
	TimeoutDefault          = 10 * time.Second
	ConcurrencyDefault      = 8
	ContentTypeDefault      = "application/json"
	MaxResponseBytesDefault = 512
)

// Codes of the dead rows a [Publisher] parks (beside "http_<status>").
const (
	// CodeNoURL: no URL is configured for the message's topic.
	CodeNoURL = "no_webhook_url"
	// CodeBadHeader: a header that HTTP cannot carry as it is (a control
	// character, invalid UTF-8).
	CodeBadHeader = "bad_header"
)

// ErrInvalidConfig is returned by [New] for a configuration it refuses.
var ErrInvalidConfig = errors.New("webhook: invalid config")

// Config configures a [Publisher].
type Config struct {
	// URLs maps an outbox topic to the URL its messages are POSTed to.
	// Required; a message whose topic has none is parked as dead
	// (CodeNoURL).
	URLs map[string]string
	// Keys sign every request; each gives one v1= signature, so that a
	// receiver can rotate keys. At least one, each at least 16 bytes.
	Keys [][]byte
	// Client sends the requests. Defaults to an http.Client with Timeout
	// TimeoutDefault. Redirects are never followed, whatever the Client's
	// CheckRedirect (the publisher uses a copy of it): a redirected POST
	// may go on as a GET without its body, so a 3xx parks the message
	// (http_<status>), its Location in the error.
	Client *http.Client
	// Concurrency bounds the requests in flight per batch: messages of
	// different keys go at once, messages of one key one after the other,
	// in order. Defaults to ConcurrencyDefault.
	Concurrency int
	// ContentType of the body. Defaults to ContentTypeDefault.
	ContentType string
	// MaxResponseBytes bounds how much of a refusing response's body is
	// kept in the dead row's error. Defaults to MaxResponseBytesDefault.
	MaxResponseBytes int
	// Now is the clock of the timestamps. Defaults to time.Now.
	Now func() time.Time
}

// Publisher POSTs outbox messages to HTTP endpoints, signed. It implements
// [relay.Writer]: give it to relay.New as the writer.
type Publisher struct {
	cfg Config
}

var _ relay.Writer = (*Publisher)(nil)

// New returns a publisher.
func New(cfg Config) (*Publisher, error) {
	if len(cfg.URLs) == 0 {
		return nil, fmt.Errorf("%w: URLs is empty", ErrInvalidConfig)
	}
	for topic, u := range cfg.URLs {
		p, err := url.Parse(u)
		if err != nil || (p.Scheme != "http" && p.Scheme != "https") || p.Host == "" {
			return nil, fmt.Errorf("%w: the URL of topic %q is not an http(s) URL: %q", ErrInvalidConfig, topic, safetext.Text(u, 300))
		}
	}
	if len(cfg.Keys) == 0 {
		return nil, fmt.Errorf("%w: no signing key", ErrInvalidConfig)
	}
	for i, k := range cfg.Keys {
		if len(k) < MinKeyBytes {
			return nil, fmt.Errorf("%w: signing key %d has %d bytes; at least %d", ErrInvalidConfig, i, len(k), MinKeyBytes)
		}
	}
	if cfg.Concurrency < 0 || cfg.MaxResponseBytes < 0 {
		return nil, fmt.Errorf("%w: Concurrency and MaxResponseBytes must not be negative", ErrInvalidConfig)
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{Timeout: TimeoutDefault}
	}
	// Redirects are not followed: a redirected POST may go on as a GET
	// without its body, and its 2xx would mark a message published that
	// never arrived. The 3xx itself is the answer (a permanent refusal).
	c := *cfg.Client
	c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	cfg.Client = &c
	if cfg.Concurrency == 0 {
		cfg.Concurrency = ConcurrencyDefault
	}
	if cfg.ContentType == "" {
		cfg.ContentType = ContentTypeDefault
	}
	if cfg.MaxResponseBytes == 0 {
		cfg.MaxResponseBytes = MaxResponseBytesDefault
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Publisher{cfg: cfg}, nil
}

// Close does nothing: the publisher holds no connection of its own (the
// Client's idle connections are the Client's).
func (p *Publisher) Close() error { return nil }

// WriteMessages POSTs each message and returns once every request has an
// answer: nil when all were accepted (2xx), else kafka.WriteErrors with
// each message's outcome as a relay.PublishError (see the package
// documentation for which answers are permanent, retried or an outage).
func (p *Publisher) WriteMessages(ctx context.Context, msgs ...kafka.Message) error {
	errs := make(kafka.WriteErrors, len(msgs))
	// One key's messages go one after the other, in order; keys at once.
	var order []string
	byKey := map[string][]int{}
	for i, m := range msgs {
		k := string(m.Key)
		if _, ok := byKey[k]; !ok {
			order = append(order, k)
		}
		byKey[k] = append(byKey[k], i)
	}
	sem := make(chan struct{}, p.cfg.Concurrency)
	var wg sync.WaitGroup
	for _, k := range order {
		idx := byKey[k]
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			for n, i := range idx {
				errs[i] = p.post(ctx, msgs[i])
				if errs[i] != nil {
					// Later messages of the key wait for the next try, after
					// this one, so that the key's order holds: not sent,
					// they spend no attempt and are not parked with it.
					for _, j := range idx[n+1:] {
						errs[j] = &relay.PublishError{NotSent: true,
							Err: fmt.Errorf("webhook: not sent: an earlier message of its key failed: %v", errs[i])}
					}
					return
				}
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return errs
		}
	}
	return nil
}

// post sends one message and says what its answer means.
func (p *Publisher) post(ctx context.Context, m kafka.Message) error {
	target, ok := p.cfg.URLs[m.Topic]
	if !ok {
		return &relay.PublishError{Permanent: true, Code: CodeNoURL,
			Err: fmt.Errorf("webhook: no URL is configured for topic %q", safetext.Text(m.Topic, 300))}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, target, bytes.NewReader(m.Value))
	if err != nil {
		return &relay.PublishError{Permanent: true, Code: CodeNoURL, Err: fmt.Errorf("webhook: request for topic %q: %w", m.Topic, err)}
	}
	ts := strconv.FormatInt(p.cfg.Now().Unix(), 10)
	req.Header.Set("Content-Type", p.cfg.ContentType)
	req.Header.Set(HeaderTimestamp, ts)
	idem := ""
	for _, h := range m.Headers {
		if h.Key == wire.HeaderMessageID {
			idem = string(h.Value)
		}
	}
	if idem == "" || strings.Contains(idem, ".") || headerValueProblem(idem) != "" {
		return &relay.PublishError{Permanent: true, Code: CodeBadHeader,
			Err: fmt.Errorf("webhook: the message id %q cannot be the signed Idempotency-Key (missing, or holds a dot or bytes HTTP cannot carry)",
				safetext.Text(idem, 100))}
	}
	req.Header.Set(HeaderSignature, Sign(ts, idem, m.Value, p.cfg.Keys...))
	if k := string(m.Key); k != "" && headerValueProblem(k) == "" {
		req.Header.Set(HeaderKey, k)
	}
	// Prefixed names already on the request: Sagaflow-Key, and the headers
	// set so far. HTTP names ignore case, so a header whose prefixed name
	// matches one of them would replace it (a header named "key" would
	// forge Sagaflow-Key). No other name the publisher sets has the prefix.
	taken := map[string]bool{http.CanonicalHeaderKey(HeaderKey): true}
	for _, h := range m.Headers {
		name, value := h.Key, string(h.Value)
		prefixed := http.CanonicalHeaderKey(HeaderPrefix + name)
		why := ""
		if !validHeaderName(name) {
			why = "its name is not an HTTP token of at most 256 bytes"
		} else if problem := headerValueProblem(value); problem != "" {
			why = "its value " + problem
		} else if taken[prefixed] {
			why = "as " + prefixed + " it would replace a header the request carries already (HTTP names ignore case)"
		}
		if why != "" {
			return &relay.PublishError{Permanent: true, Code: CodeBadHeader,
				Err: fmt.Errorf("webhook: header %q cannot travel over HTTP as it is: %s", safetext.Text(name, 100), why)}
		}
		taken[prefixed] = true
		if name == wire.HeaderMessageID {
			req.Header.Set(HeaderIdempotencyKey, value)
		}
		req.Header.Set(HeaderPrefix+name, value)
	}
	resp, err := p.cfg.Client.Do(req)
	if err != nil {
		return classify(err)
	}
	defer resp.Body.Close()
	snippet, _ := io.ReadAll(io.LimitReader(resp.Body, int64(p.cfg.MaxResponseBytes)))
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20)) // let the connection be reused
	switch s := resp.StatusCode; {
	case s >= 200 && s < 300:
		return nil
	case s >= 300 && s < 400:
		return &relay.PublishError{Permanent: true, Code: "http_" + strconv.Itoa(s),
			Err: fmt.Errorf("webhook: %s answered %d (to %q): redirects are not followed; configure the final URL",
				safetext.Text(req.URL.Host, 200), s, safetext.Text(resp.Header.Get("Location"), 300))}
	case s == http.StatusRequestTimeout || s == http.StatusTooManyRequests || s >= 500:
		return &relay.PublishError{Err: fmt.Errorf("webhook: %s answered %d: %s", safetext.Text(req.URL.Host, 200), s,
			safetext.Text(string(snippet), p.cfg.MaxResponseBytes))}
	default:
		return &relay.PublishError{Permanent: true, Code: "http_" + strconv.Itoa(s),
			Err: fmt.Errorf("webhook: %s refused the message with %d: %s", safetext.Text(req.URL.Host, 200), s,
				safetext.Text(string(snippet), p.cfg.MaxResponseBytes))}
	}
}

// classify judges a request that got no answer: no connection at all is an
// outage (the endpoint is down; no attempt is spent); a timeout or a cut
// connection is retried, spending an attempt (the endpoint may have acted).
func classify(err error) error {
	var dnsErr *net.DNSError
	var opErr *net.OpError
	switch {
	case errors.As(err, &dnsErr):
		return &relay.PublishError{Outage: true, Err: fmt.Errorf("webhook: %w", err)}
	case errors.As(err, &opErr) && opErr.Op == "dial":
		return &relay.PublishError{Outage: true, Err: fmt.Errorf("webhook: %w", err)}
	}
	// Retried, spending an attempt: said explicitly, since the relay would
	// take a timeout for an outage.
	return &relay.PublishError{Err: fmt.Errorf("webhook: %w", err)}
}

// Sign returns the Webhook-Signature value of body sent at timestamp (Unix
// seconds, as sent in Webhook-Timestamp) under idempotencyKey (as sent in
// Idempotency-Key, which holds no '.'): "v1=<hex>" per key, joined by ", ".
// The key is signed so that a captured request cannot be sent again under
// another Idempotency-Key to get past the receiver's deduplication.
func Sign(timestamp, idempotencyKey string, body []byte, keys ...[]byte) string {
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = "v1=" + hex.EncodeToString(mac(k, timestamp, idempotencyKey, body))
	}
	return strings.Join(parts, ", ")
}

func mac(key []byte, timestamp, idempotencyKey string, body []byte) []byte {
	h := hmac.New(sha256.New, key)
	h.Write([]byte(timestamp))
	h.Write([]byte{'.'})
	h.Write([]byte(idempotencyKey))
	h.Write([]byte{'.'})
	h.Write(body)
	return h.Sum(nil)
}

// MinKeyBytes is the shortest signing key a publisher or a receiver takes.
const MinKeyBytes = 16

func validHeaderName(s string) bool {
	if s == "" || len(s) > 256 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c <= ' ' || c >= 0x7f || strings.IndexByte("()<>@,;:\\\"/[]?={}", c) >= 0 {
			return false
		}
	}
	return true
}

// MaxHeaderValueBytes is the longest header value a publisher sends (the
// outbox refuses longer ones too); a longer one parks its message
// (CodeBadHeader).
const MaxHeaderValueBytes = 8192

// headerValueProblem says why s cannot travel as an HTTP header value as
// it is, or "" when it can. A receiver's HTTP stack drops blanks at either
// end, so a value with them would arrive changed.
func headerValueProblem(s string) string {
	switch {
	case len(s) > MaxHeaderValueBytes:
		return fmt.Sprintf("has %d bytes, more than %d", len(s), MaxHeaderValueBytes)
	case !utf8.ValidString(s):
		return "is not valid UTF-8"
	case s != strings.Trim(s, " \t"):
		return "starts or ends with a blank, which HTTP drops"
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < ' ' && c != '\t') || c == 0x7f {
			return "holds a control character"
		}
	}
	return ""
}
