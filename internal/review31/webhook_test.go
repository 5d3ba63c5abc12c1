package review31_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/sagaflow/sagaflow/transport/webhook"
)

var hookKey = []byte("0123456789abcdef-review31")

// TestWebhookPublisherLimitsAtTheExtremes: Config.Concurrency "bounds the
// requests in flight per batch" and MaxResponseBytes the refusal body kept
// (both "Defaults to" when zero). int's largest, 1, and negative values are
// refused by New (ErrInvalidConfig) or make a publisher that delivers 3
// messages of different keys, each once, every one verifying with Verify
// under Tolerance of 1 s, time.Duration's longest and MaxBodyBytes of
// int64's largest; negative verify options are refused or verify.
func TestWebhookPublisherLimitsAtTheExtremes(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		conc, maxResp int
		tol           time.Duration
	}{
		{math.MaxInt, math.MaxInt, math.MaxInt64},
		{1, 1, time.Second},
		{-1, -1, -1},
		{math.MinInt, math.MinInt, math.MinInt64},
	} {
		t.Run(fmt.Sprint(c.conc), func(t *testing.T) {
			var got atomic.Int32
			var bad atomic.Value
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				body, err := webhook.Verify(r, &webhook.VerifyOpts{Tolerance: c.tol, MaxBodyBytes: math.MaxInt64}, hookKey)
				if err != nil {
					bad.Store(err.Error())
					http.Error(w, err.Error(), http.StatusUnauthorized)
					return
				}
				if !strings.HasPrefix(string(body), `{"i":`) {
					bad.Store("body " + string(body))
				}
				got.Add(1)
				w.WriteHeader(http.StatusNoContent)
			}))
			defer srv.Close()
			p, err := webhook.New(webhook.Config{URLs: map[string]string{"t": srv.URL}, Keys: [][]byte{hookKey}, Concurrency: c.conc, MaxResponseBytes: c.maxResp})
			if err != nil {
				if !errors.Is(err, webhook.ErrInvalidConfig) {
					t.Errorf("New refused without ErrInvalidConfig: %v", err)
				}
				t.Logf("New refused: %v", err)
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			var msgs []kafka.Message
			for i := range 3 {
				msgs = append(msgs, kafka.Message{Topic: "t", Key: []byte(fmt.Sprint("k", i)), Value: []byte(fmt.Sprintf(`{"i":%d}`, i)),
					Headers: []kafka.Header{{Key: "sagaflow-message-id", Value: []byte(fmt.Sprint("m", i))}}})
			}
			err = func() (err error) {
				defer func() {
					if p := recover(); p != nil {
						err = fmt.Errorf("WriteMessages panicked: %v", p)
					}
				}()
				return p.WriteMessages(ctx, msgs...)
			}()
			if err != nil || got.Load() != 3 {
				t.Errorf("WriteMessages: %v; %d delivered; receiver's last refusal: %v", err, got.Load(), bad.Load())
			}
			if c.tol < 0 {
				t.Logf("a negative Tolerance: %d verified, refusal %v", got.Load(), bad.Load())
			}
		})
	}
}
