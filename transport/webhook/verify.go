package webhook

import (
	"crypto/hmac"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/sagaflow/sagaflow/internal/limitread"
)

// Receiver defaults.
const (
	// ToleranceDefault is how far a request's timestamp may be from the
	// receiver's clock, either way.
	ToleranceDefault = 5 * time.Minute
	// MaxBodyBytesDefault bounds the body a receiver reads.
	MaxBodyBytesDefault = 1 << 20
)

// Errors of [Verify]; each is wrapped with the detail.
var (
	// ErrNoSignature: a header is missing or malformed.
	ErrNoSignature = errors.New("webhook: missing or malformed signature headers")
	// ErrBadSignature: no signature matches the body and timestamp under
	// any key (a tampered body, a wrong key).
	ErrBadSignature = errors.New("webhook: signature does not match")
	// ErrStale: the timestamp is too far from now (a replayed request).
	ErrStale = errors.New("webhook: timestamp outside the tolerance")
	// ErrTooLarge: the body is larger than the receiver accepts.
	ErrTooLarge = errors.New("webhook: body too large")
)

// VerifyOpts tunes [Verify]; the zero value means the defaults.
type VerifyOpts struct {
	// Tolerance: ToleranceDefault when zero.
	Tolerance time.Duration
	// MaxBodyBytes: MaxBodyBytesDefault when zero.
	MaxBodyBytes int64
	// Now: time.Now when nil.
	Now func() time.Time
}

// Verify reads r's body and checks its signature (see the package
// documentation) against keys, in constant time per signature; any key
// that matches any v1= signature will do, so keys can be rotated. It
// returns the body, or an error wrapping ErrNoSignature, ErrBadSignature,
// ErrStale or ErrTooLarge.
func Verify(r *http.Request, opts *VerifyOpts, keys ...[]byte) ([]byte, error) {
	o := VerifyOpts{}
	if opts != nil {
		o = *opts
	}
	if o.Tolerance <= 0 {
		o.Tolerance = ToleranceDefault
	}
	if o.MaxBodyBytes <= 0 {
		o.MaxBodyBytes = MaxBodyBytesDefault
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("%w: the receiver has no key", ErrBadSignature)
	}
	for i, k := range keys {
		if len(k) < MinKeyBytes {
			// An empty key from an unset variable would accept anyone's
			// signature.
			return nil, fmt.Errorf("%w: the receiver's key %d has %d bytes; at least %d", ErrBadSignature, i, len(k), MinKeyBytes)
		}
	}
	idem := r.Header.Get(HeaderIdempotencyKey)
	if idem == "" || strings.Contains(idem, ".") {
		return nil, fmt.Errorf("%w: %s is missing or holds a '.'", ErrNoSignature, HeaderIdempotencyKey)
	}
	ts := r.Header.Get(HeaderTimestamp)
	sent, err := strconv.ParseInt(ts, 10, 64)
	if err != nil || ts == "" {
		return nil, fmt.Errorf("%w: %s is %q, not Unix seconds", ErrNoSignature, HeaderTimestamp, clip(ts))
	}
	if d := o.Now().Sub(time.Unix(sent, 0)); d > o.Tolerance || d < -o.Tolerance {
		// Sub saturates: a timestamp centuries away (milliseconds sent as
		// seconds) has no duration to show.
		away := d.Round(time.Second).String() + " from now"
		if d == math.MaxInt64 || d == math.MinInt64 {
			away = "centuries from now"
		}
		hint := ""
		if sent > 100_000_000_000 || sent < -100_000_000_000 {
			hint = "; it must be Unix seconds (milliseconds?)"
		}
		return nil, fmt.Errorf("%w: %s %d is %s (tolerance %s)%s", ErrStale, HeaderTimestamp, sent, away, o.Tolerance, hint)
	}
	var sigs [][]byte
	for _, part := range strings.Split(r.Header.Get(HeaderSignature), ",") {
		v, ok := strings.CutPrefix(strings.TrimSpace(part), "v1=")
		if !ok {
			continue // another scheme's signature: not ours to judge
		}
		b, err := hex.DecodeString(v)
		if err != nil || len(b) != 32 {
			return nil, fmt.Errorf("%w: a v1 signature is not 64 hex digits", ErrNoSignature)
		}
		sigs = append(sigs, b)
	}
	if len(sigs) == 0 {
		return nil, fmt.Errorf("%w: no v1= signature in %s", ErrNoSignature, HeaderSignature)
	}
	body, over, err := limitread.Read(r.Body, o.MaxBodyBytes)
	if err != nil {
		return nil, fmt.Errorf("webhook: read body: %w", err)
	}
	if over {
		return nil, fmt.Errorf("%w: more than %d bytes", ErrTooLarge, o.MaxBodyBytes)
	}
	for _, k := range keys {
		want := mac(k, ts, idem, body)
		for _, s := range sigs {
			if hmac.Equal(want, s) {
				return body, nil
			}
		}
	}
	return nil, ErrBadSignature
}

// Handler verifies each request as [Verify] does before next serves it,
// with the verified body in r.Body. It answers 400 for missing or
// malformed headers, 401 for a signature that does not match or a stale
// timestamp, 413 for a body too large, each with the reason in plain text.
func Handler(keys [][]byte, opts *VerifyOpts, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := Verify(r, opts, keys...)
		if err != nil {
			status := http.StatusUnauthorized
			switch {
			case errors.Is(err, ErrNoSignature):
				status = http.StatusBadRequest
			case errors.Is(err, ErrTooLarge):
				status = http.StatusRequestEntityTooLarge
			}
			http.Error(w, err.Error(), status)
			return
		}
		r.Body = io.NopCloser(strings.NewReader(string(body)))
		next.ServeHTTP(w, r)
	})
}

func clip(s string) string {
	if len(s) > 40 {
		return s[:40] + "…"
	}
	return s
}
