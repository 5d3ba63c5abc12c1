package shop

import (
	"encoding/json"
	"net/http"
	"strings"
	"sync"
)

// Provider is a fake payment provider with an HTTP API, run in-process. Like
// real providers it honours an Idempotency-Key header: a second request with
// a key it has seen returns the first answer and charges nothing more.
type Provider struct {
	mu      sync.Mutex
	answers map[string]providerAnswer // by idempotency key
	calls   map[string]int            // requests per key, replays included
	charges int                       // charges actually made
	refunds map[string]bool           // refunded charge ids
	// failNext counts the charge calls still to fail with a 503.
	failNext int
	// refundsDisabled makes every refund fail with a 403 (a merchant account
	// setting an operator must fix) until it is cleared.
	refundsDisabled bool
}

type providerAnswer struct {
	status int
	body   []byte
}

// NewProvider returns a provider with no charges.
func NewProvider() *Provider {
	return &Provider{answers: map[string]providerAnswer{}, calls: map[string]int{}, refunds: map[string]bool{}}
}

// FailNextCharges makes the next n charge calls fail with a 503.
func (p *Provider) FailNextCharges(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.failNext = n
}

// SetRefundsDisabled disables or enables refunds on the merchant account.
func (p *Provider) SetRefundsDisabled(disabled bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refundsDisabled = disabled
}

// Stats returns the calls made with key and the charges made in all.
func (p *Provider) Stats(key string) (calls, charges int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls[key], p.charges
}

// Refunded reports whether a charge was refunded.
func (p *Provider) Refunded(chargeID string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.refunds[chargeID]
}

type chargeRequest struct {
	Order    string `json:"order"`
	Amount   int    `json:"amount"`
	ChargeID string `json:"charge_id,omitempty"` // for refunds
}

// ServeHTTP serves POST /charges and POST /refunds.
func (p *Provider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	var req chargeRequest
	if key == "" || r.Method != http.MethodPost || json.NewDecoder(r.Body).Decode(&req) != nil {
		http.Error(w, `{"error":"bad request"}`, http.StatusBadRequest)
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls[key]++
	if a, ok := p.answers[key]; ok {
		w.WriteHeader(a.status)
		_, _ = w.Write(a.body)
		return
	}
	if p.failNext > 0 && strings.HasSuffix(r.URL.Path, "/charges") {
		p.failNext--
		http.Error(w, `{"error":"try again"}`, http.StatusServiceUnavailable) // not remembered: retryable
		return
	}
	var a providerAnswer
	switch {
	case strings.HasSuffix(r.URL.Path, "/refunds"):
		if p.refundsDisabled {
			http.Error(w, `{"error":"refunds are disabled for this merchant account"}`, http.StatusForbidden)
			return
		}
		p.refunds[req.ChargeID] = true
		a = providerAnswer{http.StatusOK, []byte(`{"refunded":true}`)}
	case req.Amount > 1000:
		a = providerAnswer{http.StatusPaymentRequired, []byte(`{"error":"card declined"}`)}
	default:
		p.charges++
		a = providerAnswer{http.StatusOK, []byte(`{"charge_id":"ch_` + req.Order + `"}`)}
	}
	p.answers[key] = a
	w.WriteHeader(a.status)
	_, _ = w.Write(a.body)
}
