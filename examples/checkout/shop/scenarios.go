package shop

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/sagaflow/sagaflow/saga"
)

// Result is one scenario's outcome.
type Result struct {
	Scenario string
	OrderID  string
	Want     string
	Got      string
	OK       bool
}

// client talks to the order service's API.
type client struct {
	base string
	http *http.Client
}

func (c *client) place(key string, o PlaceOrder) (id string, replayed bool, err error) {
	body, _ := json.Marshal(o)
	req, _ := http.NewRequest(http.MethodPost, c.base+"/orders", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := c.http.Do(req)
	if err != nil {
		return "", false, err
	}
	defer resp.Body.Close()
	var out struct {
		ID    string `json:"id"`
		Error string `json:"error"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&out)
	if resp.StatusCode != http.StatusCreated {
		return "", false, fmt.Errorf("POST /orders: %s: %s", resp.Status, out.Error)
	}
	return out.ID, resp.Header.Get("Idempotent-Replayed") == "true", nil
}

func (c *client) get(id string) (*OrderView, error) {
	resp, err := c.http.Get(c.base + "/orders/" + id)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET /orders/%s: %s", id, resp.Status)
	}
	var v OrderView
	return &v, json.NewDecoder(resp.Body).Decode(&v)
}

// wait polls the order until its saga has ended.
func (c *client) wait(ctx context.Context, id string) (*OrderView, error) {
	for {
		v, err := c.get(id)
		if err != nil {
			return nil, err
		}
		if v.Saga.Status.Terminal() {
			return v, nil
		}
		select {
		case <-ctx.Done():
			return v, fmt.Errorf("order %s: saga still %s at step %s: %w", id, v.Saga.Status, v.Saga.Step, ctx.Err())
		case <-time.After(25 * time.Millisecond):
		}
	}
}

// Run places the demo's orders through the order service's API at base,
// prints each order's timeline to out, and returns every scenario's result.
func (s *System) Run(ctx context.Context, base string, out io.Writer) ([]Result, error) {
	c := &client{base: base, http: &http.Client{Timeout: 10 * time.Second}}
	s.Carrier.SetWebhook(base + WebhookPath)
	var results []Result
	scenario := func(name, want string, run func(ctx context.Context) (string, string, bool, error)) error {
		ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		defer cancel()
		id, got, ok, err := run(ctx)
		if err != nil {
			got, ok = "error: "+err.Error(), false
		}
		results = append(results, Result{Scenario: name, OrderID: id, Want: want, Got: got, OK: ok})
		if id != "" {
			if v, err := c.get(id); err == nil {
				printTimeline(out, name, v)
				printWebhooks(out, s.Carrier.Attempts(id))
			}
		}
		return nil
	}
	stock := func(sku string) int {
		var n int
		_ = s.env.Inventory.Pool.QueryRow(ctx, "SELECT available FROM "+s.env.Inventory.table("stock")+" WHERE sku = $1", sku).Scan(&n)
		return n
	}
	outcome := func(v *OrderView) string {
		got := string(v.Saga.Status) + ", order " + v.Status
		if v.Saga.LastError != nil {
			got += " (" + v.Saga.LastError.Code + ")"
		}
		return got
	}
	place := func(ctx context.Context, key string, o PlaceOrder) (string, *OrderView, error) {
		id, _, err := c.place(key, o)
		if err != nil {
			return "", nil, err
		}
		v, err := c.wait(ctx, id)
		return id, v, err
	}

	_ = scenario("success", "completed, order delivered, shipped", func(ctx context.Context) (string, string, bool, error) {
		before := stock("book")
		id, v, err := place(ctx, "k-success", PlaceOrder{SKU: "book", Qty: 1, Amount: 50, Address: "1 Main St"})
		if err != nil {
			return id, "", false, err
		}
		shipped := s.fulfilled(ctx, id)
		got := outcome(v) + map[bool]string{true: ", shipped", false: ", not shipped"}[shipped]
		return id, got, v.Saga.Status == saga.StatusCompleted && v.Status == "delivered" && shipped && stock("book") == before-1, nil
	})
	_ = scenario("payment declined", "compensated, order rejected (card_declined), stock released", func(ctx context.Context) (string, string, bool, error) {
		before := stock("book")
		id, v, err := place(ctx, "k-declined", PlaceOrder{SKU: "book", Qty: 2, Amount: 5000, Address: "1 Main St"})
		if err != nil {
			return id, "", false, err
		}
		released := stock("book") == before
		got := outcome(v) + map[bool]string{true: ", stock released", false: ", stock NOT released"}[released]
		return id, got, v.Saga.Status == saga.StatusCompensated && v.Status == "rejected" && v.Saga.LastError.Code == "card_declined" && released, nil
	})
	_ = scenario("out of stock", "compensated, order rejected (out_of_stock)", func(ctx context.Context) (string, string, bool, error) {
		id, v, err := place(ctx, "k-oos", PlaceOrder{SKU: "lamp", Qty: 1, Amount: 30, Address: "1 Main St"})
		if err != nil {
			return id, "", false, err
		}
		return id, outcome(v), v.Saga.Status == saga.StatusCompensated && v.Status == "rejected" && v.Saga.LastError.Code == "out_of_stock", nil
	})
	_ = scenario("provider blip", "completed after 2 failed calls, charged once", func(ctx context.Context) (string, string, bool, error) {
		s.Provider.FailNextCharges(2)
		_, chargesBefore := s.Provider.Stats("")
		id, v, err := place(ctx, "k-blip", PlaceOrder{SKU: "book", Qty: 1, Amount: 80, Address: "1 Main St"})
		if err != nil {
			return id, "", false, err
		}
		calls, charges := s.Provider.Stats(v.SagaID.String() + "/charge/forward/0")
		got := fmt.Sprintf("%s, %d provider calls with one key, %d charge", outcome(v), calls, charges-chargesBefore)
		return id, got, v.Saga.Status == saga.StatusCompleted && calls == 3 && charges-chargesBefore == 1, nil
	})
	_ = scenario("duplicate POST", "one order, one saga; the retry gets the stored answer", func(ctx context.Context) (string, string, bool, error) {
		o := PlaceOrder{SKU: "book", Qty: 1, Amount: 20, Address: "2 Side St"}
		id, _, err := c.place("k-dup", o)
		if err != nil {
			return "", "", false, err
		}
		again, replayed, err := c.place("k-dup", o)
		if err != nil {
			return id, "", false, err
		}
		v, err := c.wait(ctx, id)
		if err != nil {
			return id, "", false, err
		}
		res, err := s.Engine.List(ctx, &saga.ListOpts{BusinessKey: id})
		if err != nil {
			return id, "", false, err
		}
		got := fmt.Sprintf("%s, same id %v, replayed %v, %d saga", outcome(v), again == id, replayed, len(res.Sagas))
		return id, got, again == id && replayed && len(res.Sagas) == 1 && v.Saga.Status == saga.StatusCompleted, nil
	})
	_ = scenario("participant crash", "completed; inventory crashed after its commit, before its offset: stock taken once, one reply", func(ctx context.Context) (string, string, bool, error) {
		s.CrashInventoryOn.Store("mug")
		before := stock("mug")
		id, v, err := place(ctx, "k-crash", PlaceOrder{SKU: "mug", Qty: 3, Amount: 25, Address: "3 High St"})
		if err != nil {
			return id, "", false, err
		}
		inv := s.env.Inventory
		var reservations, replies int
		_ = inv.Pool.QueryRow(ctx, "SELECT count(*) FROM "+inv.table("reservations")+" WHERE order_id = $1", id).Scan(&reservations)
		_ = inv.Pool.QueryRow(ctx, "SELECT count(*) FROM "+inv.table("outbox")+" WHERE step_key = $1 AND type = 'sagaflow.reply'",
			v.SagaID.String()+"/reserve/forward/0").Scan(&replies)
		crashes, taken := s.inventoryCrashes.Load(), before-stock("mug")
		got := fmt.Sprintf("%s, %d crash, %d taken, %d reservation, %d reply", outcome(v), crashes, taken, reservations, replies)
		return id, got, v.Saga.Status == saga.StatusCompleted && crashes == 1 && taken == 3 && reservations == 1 && replies == 1, nil
	})
	_ = scenario("replay after fix", "failed (refund_failed), then replayed: compensated, refunded", func(ctx context.Context) (string, string, bool, error) {
		s.Provider.SetRefundsDisabled(true)
		id, v, err := place(ctx, "k-replay", PlaceOrder{SKU: "book", Qty: 1, Amount: 60, Address: "nowhere"})
		if err != nil {
			return id, "", false, err
		}
		first := outcome(v)
		if v.Saga.Status != saga.StatusFailed {
			return id, first, false, nil
		}
		s.Provider.SetRefundsDisabled(false) // the cause is fixed
		if err := s.Engine.Resume(ctx, v.SagaID, "refunds work again"); err != nil {
			return id, first, false, err
		}
		v, err = c.wait(ctx, id)
		if err != nil {
			return id, first, false, err
		}
		refunded := s.Provider.Refunded("ch_" + id)
		got := first + " → " + outcome(v) + map[bool]string{true: ", refunded", false: ", NOT refunded"}[refunded]
		return id, got, strings.HasPrefix(first, "failed") && v.Saga.Status == saga.StatusCompensated && refunded, nil
	})
	_ = scenario("delivered", "completed, order delivered: picked (Kafka), delivered (webhook sent twice, one signal)", func(ctx context.Context) (string, string, bool, error) {
		id, v, err := place(ctx, "k-delivered", PlaceOrder{SKU: "book", Qty: 1, Amount: 40, Address: "4 Elm St"})
		if err != nil {
			return id, "", false, err
		}
		// The carrier's second webhook may still be on its way when the
		// saga has ended.
		attempts := s.webhooks(ctx, id, 2)
		sigs, err := s.Engine.Signals(ctx, v.SagaID)
		if err != nil {
			return id, "", false, err
		}
		count := map[string]int{}
		for _, sg := range sigs {
			count[sg.Name+" "+sg.Status]++
		}
		replayed := 0
		for _, a := range attempts {
			if a.Replayed {
				replayed++
			}
		}
		got := fmt.Sprintf("%s, %d picked and %d delivered signal, %d webhooks of which %d replayed",
			outcome(v), count[SignalPicked+" delivered"], count[SignalDelivered+" delivered"], len(attempts), replayed)
		return id, got, v.Saga.Status == saga.StatusCompleted && v.Status == "delivered" && len(sigs) == 2 &&
			count[SignalPicked+" delivered"] == 1 && count[SignalDelivered+" delivered"] == 1 &&
			len(attempts) == 2 && !attempts[0].Replayed && attempts[1].Replayed, nil
	})
	_ = scenario("never delivered", fmt.Sprintf("compensated after the %s escalation, order cancelled (wait_timeout), refunded, stock released", s.env.Escalation),
		func(ctx context.Context) (string, string, bool, error) {
			before := stock("book")
			id, v, err := place(ctx, "k-lost", PlaceOrder{SKU: "book", Qty: 1, Amount: 70, Address: LostAddress})
			if err != nil {
				return id, "", false, err
			}
			refunded, released := s.Provider.Refunded("ch_"+id), stock("book") == before
			got := outcome(v) + map[bool]string{true: ", refunded", false: ", NOT refunded"}[refunded] +
				map[bool]string{true: ", stock released", false: ", stock NOT released"}[released]
			return id, got, v.Saga.Status == saga.StatusCompensated && v.Status == "cancelled" &&
				v.Saga.LastError != nil && v.Saga.LastError.Code == saga.CodeWaitTimeout && refunded && released, nil
		})
	return results, nil
}

// webhooks waits until the carrier has had n answers about the order, and
// returns them.
func (s *System) webhooks(ctx context.Context, orderID string, n int) []WebhookAttempt {
	for {
		a := s.Carrier.Attempts(orderID)
		if len(a) >= n || ctx.Err() != nil {
			return a
		}
		time.Sleep(25 * time.Millisecond)
	}
}

// fulfilled waits for the shipping service's fulfilment saga of the order.
func (s *System) fulfilled(ctx context.Context, orderID string) bool {
	for ctx.Err() == nil {
		res, err := s.Ship.List(ctx, &saga.ListOpts{BusinessKey: orderID})
		if err == nil && len(res.Sagas) == 1 && res.Sagas[0].Status == saga.StatusCompleted {
			return true
		}
		time.Sleep(25 * time.Millisecond)
	}
	return false
}

func printTimeline(out io.Writer, name string, v *OrderView) {
	fmt.Fprintf(out, "\n== %s: order %s (%s), saga %s\n", name, v.ID, v.Status, v.SagaID)
	if v.Saga == nil || len(v.Saga.History) == 0 {
		return
	}
	t0 := v.Saga.History[0].At
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	for _, ev := range v.Saga.History {
		line := fmt.Sprintf("  +%.1fms\t%s\t%s\t%s", float64(ev.At.Sub(t0).Microseconds())/1000, ev.Type, ev.Step, ev.Direction)
		if ev.Error != "" {
			line += "\t" + ev.Error + " (" + ev.ErrorCode + ")"
		}
		fmt.Fprintln(w, line)
	}
	_ = w.Flush()
}

// printWebhooks adds the carrier's webhooks about an order to its timeline.
func printWebhooks(out io.Writer, attempts []WebhookAttempt) {
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	for i, a := range attempts {
		what := "first"
		if i > 0 {
			what = "resent"
		}
		line := fmt.Sprintf("  carrier\twebhook %s\tPOST %s, Idempotency-Key %s\t→ %d %s", what, WebhookPath, a.Key, a.Status, http.StatusText(a.Status))
		if a.Replayed {
			line += ", Idempotent-Replayed: the stored answer, no second signal"
		}
		fmt.Fprintln(w, line)
	}
	_ = w.Flush()
}

// PrintSummary prints the results as a table and reports whether all passed.
func PrintSummary(out io.Writer, results []Result) bool {
	fmt.Fprintln(out, "\nSummary")
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "  scenario\torder\texpected\tgot\tok")
	all := true
	for _, r := range results {
		mark := "yes"
		if !r.OK {
			mark, all = "NO", false
		}
		fmt.Fprintf(w, "  %s\t%s\t%s\t%s\t%s\n", r.Scenario, r.OrderID, r.Want, r.Got, mark)
	}
	_ = w.Flush()
	return all
}
