package shop

import (
	"bytes"
	"encoding/json"
	"net/http"
	"sync"
	"time"
)

// LostAddress is where the carrier's parcels never arrive: an order
// shipped there waits for its delivery until the escalation cancels it.
const LostAddress = "13 Lost Lane"

// WebhookPath is where the order service receives the carrier's webhooks.
const WebhookPath = "/webhooks/carrier"

// Carrier is a fake carrier, run in-process. It takes each order's parcel
// once and, when it has delivered it, tells the order service with a
// webhook carrying an Idempotency-Key. Like carriers that resend when an
// answer is slow to come, it sends every webhook twice with the same key:
// the second must have no effect.
type Carrier struct {
	mu       sync.Mutex
	webhook  string
	ready    chan struct{} // closed once the webhook's URL is known
	done     chan struct{} // closed by Close
	closed   bool
	parcels  map[string]bool // by order id
	attempts map[string][]WebhookAttempt
	wg       sync.WaitGroup
	client   *http.Client
}

// WebhookAttempt is one webhook the carrier sent, and the answer.
type WebhookAttempt struct {
	Key      string
	Status   int
	Replayed bool // the answer carried Idempotent-Replayed: true
}

// NewCarrier returns a carrier with no parcels. It sends nothing until
// SetWebhook.
func NewCarrier() *Carrier {
	return &Carrier{ready: make(chan struct{}), done: make(chan struct{}), parcels: map[string]bool{},
		attempts: map[string][]WebhookAttempt{}, client: &http.Client{Timeout: 5 * time.Second}}
}

// SetWebhook sets the URL of the order service's webhook (the first call
// wins) and lets the carrier deliver.
func (c *Carrier) SetWebhook(url string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.webhook == "" {
		c.webhook = url
		close(c.ready)
	}
}

// Collect hands the order's parcel to the carrier; a second hand-over of
// the same order is ignored. Parcels to LostAddress are never delivered.
func (c *Carrier) Collect(orderID, address string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || c.parcels[orderID] {
		return
	}
	c.parcels[orderID] = true
	if address == LostAddress {
		return
	}
	c.wg.Go(func() { c.deliver(orderID) })
}

// deliver sends the order's "delivered" webhook until the order service
// answers it (anything but a 5xx), then once more with the same key.
func (c *Carrier) deliver(orderID string) {
	select {
	case <-c.ready:
	case <-c.done:
		return
	}
	ev := CarrierEvent{Event: "delivered", OrderID: orderID, Tracking: "TRK-" + orderID}
	key := "dlv-" + orderID
	body, _ := json.Marshal(ev)
	for sent := 0; sent < 2; {
		a, err := c.send(key, body)
		// 409: the first answer is not stored yet (the idempotency
		// middleware's in-flight key); like a 5xx, try again.
		if err == nil && a.Status < 500 && a.Status != http.StatusConflict {
			c.mu.Lock()
			c.attempts[orderID] = append(c.attempts[orderID], a)
			c.mu.Unlock()
			sent++
			continue
		}
		select {
		case <-c.done:
			return
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (c *Carrier) send(key string, body []byte) (WebhookAttempt, error) {
	req, err := http.NewRequest(http.MethodPost, c.webhook, bytes.NewReader(body))
	if err != nil {
		return WebhookAttempt{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := c.client.Do(req)
	if err != nil {
		return WebhookAttempt{}, err
	}
	defer resp.Body.Close()
	return WebhookAttempt{Key: key, Status: resp.StatusCode, Replayed: resp.Header.Get("Idempotent-Replayed") == "true"}, nil
}

// Attempts returns the webhooks the carrier sent about the order and their
// answers, in order.
func (c *Carrier) Attempts(orderID string) []WebhookAttempt {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]WebhookAttempt(nil), c.attempts[orderID]...)
}

// Close stops the carrier's deliveries and waits for them.
func (c *Carrier) Close() {
	c.mu.Lock()
	if !c.closed {
		c.closed = true
		close(c.done)
	}
	c.mu.Unlock()
	c.wg.Wait()
}
