package shop

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/trace"

	"github.com/sagaflow/sagaflow/inbox"
	"github.com/sagaflow/sagaflow/migrations"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/participant"
	"github.com/sagaflow/sagaflow/relay"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// Topics the services talk on.
const (
	TopicInventory = "inventory.commands"
	TopicPayments  = "payments.commands"
	TopicShipping  = "shipping.commands"
	TopicReplies   = "orders.replies"
	// TopicWarehouse carries the warehouse's events (WarehousePicked) to
	// whoever follows them: the order service maps them to signals.
	TopicWarehouse = "warehouse.events"
)

// Topics lists every topic the system needs, with the saga's command topic.
var Topics = []string{saga.CommandTopicDefault + ".checkout", TopicInventory, TopicPayments, TopicShipping, TopicReplies, TopicWarehouse}

// EscalationDefault is how long an order waits for the carrier's
// "delivered" webhook before it is cancelled and refunded.
const EscalationDefault = 48 * time.Hour

// Signals the checkout saga awaits after payment and shipment.
const (
	SignalPicked    = "picked"    // from the warehouse's Kafka topic
	SignalDelivered = "delivered" // from the carrier's webhook
)

// Order is the checkout saga's state.
type Order struct {
	ID       string `json:"id"`
	SKU      string `json:"sku"`
	Qty      int    `json:"qty"`
	Amount   int    `json:"amount"`
	Address  string `json:"address"`
	ChargeID string `json:"charge_id,omitempty"`
	Tracking string `json:"tracking,omitempty"`
}

// Commands and replies between the services: their contracts are in
// docs/events/.
type (
	ReserveStock struct {
		OrderID string `json:"order_id"`
		SKU     string `json:"sku"`
		Qty     int    `json:"qty"`
	}
	ChargePayment struct {
		OrderID string `json:"order_id"`
		Amount  int    `json:"amount"`
	}
	RefundPayment struct {
		OrderID  string `json:"order_id"`
		ChargeID string `json:"charge_id"`
	}
	CreateShipment struct {
		OrderID string `json:"order_id"`
		Address string `json:"address"`
	}
	PaymentCharged struct {
		ChargeID string `json:"charge_id"`
	}
	// WarehousePicked is the warehouse's event on TopicWarehouse: the
	// order's parcel is picked and packed, ready for the carrier.
	WarehousePicked struct {
		OrderID string `json:"order_id"`
		Picker  string `json:"picker"`
	}
	// CarrierEvent is the body of the carrier's webhook, POST
	// /webhooks/carrier.
	CarrierEvent struct {
		Event    string `json:"event"` // "delivered"
		OrderID  string `json:"order_id"`
		Tracking string `json:"tracking"`
	}
)

// DB is one service's schema.
type DB struct {
	Pool   *pgxpool.Pool
	Schema string
}

func (d DB) table(name string) string { return pgx.Identifier{d.Schema, name}.Sanitize() }

// Env is what the system runs on.
type Env struct {
	Orders, Inventory, Payments, Shipping DB
	// Brokers and Dialer reach Kafka, unless Bus is set.
	Brokers []string
	Dialer  *kafka.Dialer
	// Bus, when set, carries the messages instead of Kafka (NATSBus).
	Bus    Bus
	Logger *slog.Logger
	// Escalation is how long an order waits for its delivery before it is
	// cancelled and refunded. Defaults to EscalationDefault; the demo
	// compresses it to seconds.
	Escalation time.Duration
	// Tracing, when set, gives each service ("orders", "inventory",
	// "payments", "shipping") its TracerProvider; nil uses OpenTelemetry's
	// global one.
	Tracing func(service string) trace.TracerProvider
}

// tracer is the TracerProvider of service, or nil for the global one.
func (s *System) tracer(service string) trace.TracerProvider {
	if s.env.Tracing == nil {
		return nil
	}
	return s.env.Tracing(service)
}

// System is the order service (orchestrator) and the inventory, payment and
// shipping services (participants), with the payment provider they call.
type System struct {
	env      Env
	Engine   *saga.Engine // the order service's
	Checkout *saga.Definition[Order]
	Ship     *saga.Engine // the shipping service's own engine, for fulfilment
	Provider *Provider
	Carrier  *Carrier
	provider *http.Server
	addr     string

	stop []func() // undoes Start, in reverse

	// CrashInventoryOn makes the inventory service crash, once, in the middle
	// of reserving stock of this SKU.
	CrashInventoryOn atomic.Value // string
	inventoryCrashes atomic.Int32

	// ManualFulfilment silences the warehouse's "picked" events and the
	// carrier: a test sends them itself.
	ManualFulfilment atomic.Bool
}

// Fulfilment is the shipping service's own saga: pick, pack, ship, notify.
// The shipping service is the warehouse too: its pick step publishes
// WarehousePicked on TopicWarehouse, and its ship step hands the parcel to
// the Carrier.
type Fulfilment struct {
	OrderID string `json:"order_id"`
	Address string `json:"address"`
}

func schemaSQL(d DB, stmts ...string) error {
	for _, s := range stmts {
		if _, err := d.Pool.Exec(context.Background(), strings.ReplaceAll(s, "{s}", pgx.Identifier{d.Schema}.Sanitize())); err != nil {
			return err
		}
	}
	return nil
}

// Start migrates every schema, creates the services' tables and starts
// everything: relays, consumers, engines, the provider. Stop undoes it.
func Start(ctx context.Context, env Env) (*System, error) {
	if env.Escalation <= 0 {
		env.Escalation = EscalationDefault
	}
	s := &System{env: env, Provider: NewProvider(), Carrier: NewCarrier()}
	s.stop = append(s.stop, s.Carrier.Close)
	for _, d := range []DB{env.Orders, env.Inventory, env.Payments, env.Shipping} {
		if _, err := migrations.Migrate(ctx, d.Pool, d.Schema); err != nil {
			return nil, err
		}
	}
	err := errors.Join(
		schemaSQL(env.Orders, `CREATE TABLE IF NOT EXISTS {s}.orders (id text PRIMARY KEY, sku text, qty int, amount int,
			address text, status text NOT NULL, saga_id uuid, created_at timestamptz DEFAULT now())`,
			`CREATE TABLE IF NOT EXISTS {s}.carrier_webhooks (id bigserial PRIMARY KEY, order_id text NOT NULL, event text NOT NULL,
			tracking text NOT NULL, received_at timestamptz DEFAULT clock_timestamp())`),
		schemaSQL(env.Inventory, `CREATE TABLE IF NOT EXISTS {s}.stock (sku text PRIMARY KEY, available int NOT NULL CHECK (available >= 0))`,
			`CREATE TABLE IF NOT EXISTS {s}.reservations (order_id text PRIMARY KEY, sku text, qty int, released boolean DEFAULT false)`,
			`INSERT INTO {s}.stock VALUES ('book', 100), ('lamp', 0), ('mug', 10) ON CONFLICT DO NOTHING`),
		schemaSQL(env.Payments, `CREATE TABLE IF NOT EXISTS {s}.payments (order_id text PRIMARY KEY, charge_id text, refunded boolean DEFAULT false)`),
		schemaSQL(env.Shipping, `CREATE TABLE IF NOT EXISTS {s}.shipments (order_id text PRIMARY KEY, address text)`,
			`CREATE TABLE IF NOT EXISTS {s}.fulfilment_log (order_id text, step text, at timestamptz DEFAULT clock_timestamp())`),
	)
	if err != nil {
		return nil, fmt.Errorf("shop: create tables: %w", err)
	}
	if err := s.startProvider(); err != nil {
		return nil, err
	}
	for i, d := range []DB{env.Orders, env.Inventory, env.Payments, env.Shipping} {
		if err := s.startRelay(ctx, d, []string{"orders", "inventory", "payments", "shipping"}[i]); err != nil {
			s.Stop()
			return nil, err
		}
	}
	if err := errors.Join(s.startInventory(ctx), s.startPayments(ctx), s.startShipping(ctx), s.startOrders(ctx)); err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

// bus is Env.Bus, or Kafka at Env.Brokers.
func (s *System) bus() Bus {
	if s.env.Bus != nil {
		return s.env.Bus
	}
	return kafkaBus{brokers: s.env.Brokers, dialer: s.env.Dialer}
}

// Stop stops every part, the orchestrator first.
func (s *System) Stop() {
	for i := len(s.stop) - 1; i >= 0; i-- {
		s.stop[i]()
	}
	s.stop = nil
}

func (s *System) startProvider() error {
	srv := &http.Server{Handler: s.Provider, ReadHeaderTimeout: 5 * time.Second}
	ln, err := listen()
	if err != nil {
		return fmt.Errorf("shop: provider: %w", err)
	}
	s.addr = "http://" + ln.Addr().String()
	go func() { _ = srv.Serve(ln) }()
	s.provider = srv
	s.stop = append(s.stop, func() { _ = srv.Close() })
	return nil
}

func (s *System) startRelay(ctx context.Context, d DB, service string) error {
	w, err := s.bus().Writer()
	if err != nil {
		return err
	}
	r, err := relay.New(d.Pool, w, &relay.Config{Schema: d.Schema, PollInterval: 200 * time.Millisecond, Logger: s.env.Logger,
		TracerProvider: s.tracer(service)})
	if err != nil {
		return err
	}
	if err := r.Start(ctx); err != nil {
		return err
	}
	s.stop = append(s.stop, func() {
		_ = r.Stop(context.Background())
		_ = w.Close()
	})
	return nil
}

// consume runs a consumer of topic into in, with handlers, restarting it
// when it crashes, until the system stops.
func (s *System) consume(service, topic, group string, in *inbox.Inbox, handlers map[string]inbox.HandlerFunc, crashes func() bool) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		for ctx.Err() == nil {
			r, err := s.bus().Reader(group, topic)
			if err != nil {
				panic(err) // a programming error: the group and topic are the example's own
			}
			runCtx, stopRun := context.WithCancel(ctx)
			reader := &crashingReader{BusReader: r, crashes: crashes, crash: stopRun}
			c, err := in.NewConsumer(reader, &inbox.ConsumerConfig{Handlers: handlers, RetryMax: time.Second,
				TracerProvider: s.tracer(service)})
			if err != nil {
				panic(err) // a programming error: the handlers are registered above
			}
			_ = c.Run(runCtx)
			stopRun()
			_ = r.Close()
		}
	})
	s.stop = append(s.stop, func() { cancel(); wg.Wait() })
}

// crashingReader makes its consumer "die" when crashes says so: after the
// message's transaction committed and before its offset is committed, the
// one moment where only deduplication prevents a second effect.
type crashingReader struct {
	BusReader
	crashes func() bool
	crash   func()
}

func (r *crashingReader) CommitMessages(ctx context.Context, msgs ...kafka.Message) error {
	if r.crashes != nil && r.crashes() {
		r.crash()
		return errors.New("the service crashed before committing the offset")
	}
	return r.BusReader.CommitMessages(ctx, msgs...)
}

func (s *System) participant(d DB, name string) (*participant.Participant, error) {
	return participant.New(d.Pool, &participant.Config{Consumer: name, Schema: d.Schema, Logger: s.env.Logger,
		ReplyTopics: []string{TopicReplies}, TracerProvider: s.tracer(name)})
}

// startInventory: reserve stock, and release it as the compensation.
func (s *System) startInventory(context.Context) error {
	d := s.env.Inventory
	p, err := s.participant(d, "inventory")
	if err != nil {
		return err
	}
	var crashNow atomic.Bool
	err = errors.Join(
		participant.Handle(p, "inventory.reserve", func(ctx context.Context, tx pgx.Tx, c participant.Call[ReserveStock]) (struct{}, error) {
			tag, err := tx.Exec(ctx, "UPDATE "+d.table("stock")+" SET available = available - $2 WHERE sku = $1 AND available >= $2", c.Command.SKU, c.Command.Qty)
			if err != nil {
				return struct{}{}, err
			}
			if tag.RowsAffected() == 0 {
				return struct{}{}, steps.Permanent(steps.WithCode("out_of_stock", fmt.Errorf("%d × %s not available", c.Command.Qty, c.Command.SKU)))
			}
			if _, err := tx.Exec(ctx, "INSERT INTO "+d.table("reservations")+" (order_id, sku, qty) VALUES ($1, $2, $3)", c.Command.OrderID, c.Command.SKU, c.Command.Qty); err != nil {
				return struct{}{}, err
			}
			if v, _ := s.CrashInventoryOn.Load().(string); v == c.Command.SKU && s.inventoryCrashes.Load() == 0 {
				// The service will crash once this transaction has
				// committed, before the message's offset is committed: the
				// command is delivered again after the restart.
				s.inventoryCrashes.Add(1)
				crashNow.Store(true)
			}
			return struct{}{}, nil
		}),
		participant.Handle(p, "inventory.release", func(ctx context.Context, tx pgx.Tx, c participant.Call[ReserveStock]) (struct{}, error) {
			var sku string
			var qty int
			err := tx.QueryRow(ctx, "UPDATE "+d.table("reservations")+" SET released = true WHERE order_id = $1 AND NOT released RETURNING sku, qty", c.Command.OrderID).Scan(&sku, &qty)
			if errors.Is(err, pgx.ErrNoRows) {
				return struct{}{}, nil // nothing reserved (or released already)
			}
			if err != nil {
				return struct{}{}, err
			}
			_, err = tx.Exec(ctx, "UPDATE "+d.table("stock")+" SET available = available + $2 WHERE sku = $1", sku, qty)
			return struct{}{}, err
		}),
	)
	if err != nil {
		return err
	}
	s.consume("inventory", TopicInventory, "inventory", p.Inbox(), p.Handlers(), func() bool {
		return crashNow.CompareAndSwap(true, false)
	})
	return nil
}

// callProvider posts to the payment provider with the step's key as the
// Idempotency-Key: a retry can never charge twice.
func (s *System) callProvider(ctx context.Context, path, key string, body any) (int, []byte, error) {
	b, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.addr+path, strings.NewReader(string(b)))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	var out json.RawMessage
	_ = json.NewDecoder(resp.Body).Decode(&out)
	return resp.StatusCode, out, nil
}

// startPayments: charge through the provider, refund as the compensation.
func (s *System) startPayments(context.Context) error {
	d := s.env.Payments
	p, err := s.participant(d, "payments")
	if err != nil {
		return err
	}
	err = errors.Join(
		participant.Handle(p, "payments.charge", func(ctx context.Context, tx pgx.Tx, c participant.Call[ChargePayment]) (PaymentCharged, error) {
			status, body, err := s.callProvider(ctx, "/charges", c.Key.String(), chargeRequest{Order: c.Command.OrderID, Amount: c.Command.Amount})
			switch {
			case err != nil || status >= 500:
				return PaymentCharged{}, fmt.Errorf("provider unavailable (status %d): %v", status, err) // retried, same key
			case status == http.StatusPaymentRequired:
				return PaymentCharged{}, steps.Permanent(steps.WithCode("card_declined", errors.New("the card was declined")))
			case status != http.StatusOK:
				return PaymentCharged{}, steps.Permanent(fmt.Errorf("provider answered %d: %s", status, body))
			}
			var res struct {
				ChargeID string `json:"charge_id"`
			}
			if err := json.Unmarshal(body, &res); err != nil {
				return PaymentCharged{}, err
			}
			_, err = tx.Exec(ctx, "INSERT INTO "+d.table("payments")+" (order_id, charge_id) VALUES ($1, $2)", c.Command.OrderID, res.ChargeID)
			return PaymentCharged{ChargeID: res.ChargeID}, err
		}),
		participant.Handle(p, "payments.refund", func(ctx context.Context, tx pgx.Tx, c participant.Call[RefundPayment]) (struct{}, error) {
			// Refund what this service charged for the order, whatever the
			// saga knows: after a reply timeout the saga never saw the charge
			// id, and a late charge is processed before this refund (same
			// partition, in order).
			var chargeID string
			var refunded bool
			err := tx.QueryRow(ctx, "SELECT charge_id, refunded FROM "+d.table("payments")+" WHERE order_id = $1 FOR UPDATE", c.Command.OrderID).Scan(&chargeID, &refunded)
			if errors.Is(err, pgx.ErrNoRows) || refunded {
				return struct{}{}, nil // nothing charged, or refunded already
			}
			if err != nil {
				return struct{}{}, err
			}
			status, body, err := s.callProvider(ctx, "/refunds", c.Key.String(), chargeRequest{Order: c.Command.OrderID, ChargeID: chargeID})
			switch {
			case err != nil || status >= 500:
				return struct{}{}, fmt.Errorf("provider unavailable (status %d): %v", status, err) // retried, same key
			case status != http.StatusOK:
				return struct{}{}, steps.Permanent(steps.WithCode("refund_failed", fmt.Errorf("provider answered %d: %s", status, body)))
			}
			_, err = tx.Exec(ctx, "UPDATE "+d.table("payments")+" SET refunded = true WHERE order_id = $1", c.Command.OrderID)
			return struct{}{}, err
		}),
	)
	if err != nil {
		return err
	}
	s.consume("payments", TopicPayments, "payments", p.Inbox(), p.Handlers(), nil)
	return nil
}

// startShipping: create a shipment, starting the shipping service's own
// fulfilment saga in the same transaction.
func (s *System) startShipping(ctx context.Context) error {
	d := s.env.Shipping
	logStep := func(name string) saga.StepFunc[Fulfilment] {
		return func(ctx context.Context, run *saga.StepRun, f *Fulfilment) error {
			_, err := run.Tx.Exec(ctx, "INSERT INTO "+d.table("fulfilment_log")+" (order_id, step) VALUES ($1, $2)", f.OrderID, name)
			return err
		}
	}
	// The warehouse tells whoever follows its topic that the parcel is
	// picked: an event in its outbox, in the step's transaction, that the
	// relay publishes after the commit.
	events, err := outbox.New(d.Pool, d.Schema)
	if err != nil {
		return err
	}
	pick := func(ctx context.Context, run *saga.StepRun, f *Fulfilment) error {
		if err := logStep("pick")(ctx, run, f); err != nil || s.ManualFulfilment.Load() {
			return err
		}
		body, err := json.Marshal(WarehousePicked{OrderID: f.OrderID, Picker: "bay-7"})
		if err != nil {
			return err
		}
		return events.InsertTx(ctx, run.Tx, outbox.Message{Topic: TopicWarehouse, Key: f.OrderID, Type: "WarehousePicked", Payload: body})
	}
	// The parcel goes to the carrier, which calls the order service's
	// webhook when it is delivered. The carrier takes a parcel once per
	// order, so a retried step hands nothing over twice.
	handOver := func(ctx context.Context, run *saga.StepRun, f *Fulfilment) error {
		if err := logStep("ship")(ctx, run, f); err != nil || s.ManualFulfilment.Load() {
			return err
		}
		s.Carrier.Collect(f.OrderID, f.Address)
		return nil
	}
	fulfil := saga.Define("fulfilment",
		saga.Step[Fulfilment]{Name: "pick", Action: pick, Compensate: logStep("restock")},
		saga.Step[Fulfilment]{Name: "pack", Action: logStep("pack"), Compensate: logStep("unpack")},
		saga.Step[Fulfilment]{Name: "ship", Action: handOver},
		saga.Step[Fulfilment]{Name: "notify", Action: logStep("notify")},
	)
	engine, err := saga.New(d.Pool, &saga.Config{Schema: d.Schema, Workers: 2, PollInterval: 100 * time.Millisecond, Logger: s.env.Logger,
		TracerProvider: s.tracer("shipping")})
	if err != nil {
		return err
	}
	if err := engine.Register(fulfil); err != nil {
		return err
	}
	if err := engine.Start(ctx); err != nil {
		return err
	}
	s.Ship = engine
	s.stop = append(s.stop, func() { _ = engine.Stop(context.Background()) })
	p, err := s.participant(d, "shipping")
	if err != nil {
		return err
	}
	err = participant.Handle(p, "shipping.create", func(ctx context.Context, tx pgx.Tx, c participant.Call[CreateShipment]) (struct{}, error) {
		if c.Command.Address == "nowhere" {
			return struct{}{}, steps.Permanent(steps.WithCode("undeliverable", errors.New("no carrier delivers to this address")))
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+d.table("shipments")+" VALUES ($1, $2)", c.Command.OrderID, c.Command.Address); err != nil {
			return struct{}{}, err
		}
		_, err := saga.StartTx(ctx, engine, tx, fulfil, Fulfilment{OrderID: c.Command.OrderID, Address: c.Command.Address},
			&saga.StartOpts{BusinessKey: c.Command.OrderID})
		return struct{}{}, err
	})
	if err != nil {
		return err
	}
	s.consume("shipping", TopicShipping, "shipping", p.Inbox(), p.Handlers(), nil)
	return nil
}

// startOrders: the checkout saga and its engine.
func (s *System) startOrders(ctx context.Context) error {
	d := s.env.Orders
	setStatus := func(status string) saga.StepFunc[Order] {
		return func(ctx context.Context, run *saga.StepRun, o *Order) error {
			_, err := run.Tx.Exec(ctx, "UPDATE "+d.table("orders")+" SET status = $2 WHERE id = $1", o.ID, status)
			return err
		}
	}
	// The order is rejected when it fails before it was confirmed, and
	// cancelled (by confirm's compensation) when it fails after.
	reject := func(ctx context.Context, run *saga.StepRun, o *Order) error {
		_, err := run.Tx.Exec(ctx, "UPDATE "+d.table("orders")+" SET status = 'rejected' WHERE id = $1 AND status <> 'cancelled'", o.ID)
		return err
	}
	s.Checkout = saga.Define("checkout",
		saga.Step[Order]{Name: "accept", Action: setStatus("accepted"), Compensate: reject},
		saga.Step[Order]{Name: "reserve", Timeout: 20 * time.Second, Remote: &saga.Remote[Order]{
			Topic: TopicInventory, Type: "inventory.reserve", CompensateType: "inventory.release",
			Command: func(_ context.Context, _ *saga.StepRun, o *Order) (any, error) {
				return ReserveStock{OrderID: o.ID, SKU: o.SKU, Qty: o.Qty}, nil
			},
		}},
		saga.Step[Order]{Name: "charge", Timeout: 20 * time.Second, Remote: &saga.Remote[Order]{
			Topic: TopicPayments, Type: "payments.charge", CompensateType: "payments.refund",
			Command: func(_ context.Context, _ *saga.StepRun, o *Order) (any, error) {
				return ChargePayment{OrderID: o.ID, Amount: o.Amount}, nil
			},
			CompensateCommand: func(_ context.Context, _ *saga.StepRun, o *Order) (any, error) {
				return RefundPayment{OrderID: o.ID, ChargeID: o.ChargeID}, nil
			},
			OnReply: func(_ context.Context, _ *saga.StepRun, o *Order, result json.RawMessage) error {
				var r PaymentCharged
				if err := json.Unmarshal(result, &r); err != nil {
					return err
				}
				o.ChargeID = r.ChargeID
				return nil
			},
		}},
		saga.Step[Order]{Name: "ship", Timeout: 20 * time.Second, Remote: &saga.Remote[Order]{
			Topic: TopicShipping, Type: "shipping.create",
			Command: func(_ context.Context, _ *saga.StepRun, o *Order) (any, error) {
				return CreateShipment{OrderID: o.ID, Address: o.Address}, nil
			},
		}},
		saga.Step[Order]{Name: "confirm", Action: setStatus("confirmed"), Compensate: setStatus("cancelled")},
		// Fulfilment, the part of the order that waits: for the warehouse's
		// event (a signal from Kafka, see consumeWarehouse), then for the
		// carrier's webhook (a signal sent by the webhook's handler). A
		// signal that comes early is kept until its step awaits it.
		saga.Step[Order]{Name: "picked", Wait: saga.OnSignal(SignalPicked,
			func(ctx context.Context, run *saga.StepRun, o *Order, ev WarehousePicked) error {
				return setStatus("picked")(ctx, run, o)
			})},
		// The escalation: no delivery within Env.Escalation (48 hours), and
		// the step fails for good (code wait_timeout); the saga compensates:
		// the order is cancelled, the payment refunded, the stock released.
		saga.Step[Order]{Name: "delivered", Wait: saga.OnSignal(SignalDelivered,
			func(ctx context.Context, run *saga.StepRun, o *Order, ev CarrierEvent) error {
				o.Tracking = ev.Tracking
				return setStatus("delivered")(ctx, run, o)
			}).Timeout(s.env.Escalation)},
	)
	engine, err := saga.New(d.Pool, &saga.Config{Schema: d.Schema, Workers: 2, Logger: s.env.Logger, RescueInterval: time.Second,
		TracerProvider: s.tracer("orders"),
		Kafka:          s.bus().EngineKafka(TopicReplies)})
	if err != nil {
		return err
	}
	if err := engine.Register(s.Checkout); err != nil {
		return err
	}
	if err := engine.Start(ctx); err != nil {
		return err
	}
	s.Engine = engine
	s.stop = append(s.stop, func() { _ = engine.Stop(context.Background()) })
	return s.consumeWarehouse(engine)
}

// consumeWarehouse follows the warehouse's topic: each WarehousePicked
// becomes the "picked" signal of the order's checkout saga, in the inbox's
// transaction. The inbox deduplicates by message id, and so does the
// signal (its id is the message id): a redelivered event has no second
// effect.
func (s *System) consumeWarehouse(engine *saga.Engine) error {
	in, err := inbox.New(s.env.Orders.Pool, &inbox.Config{Consumer: "orders-warehouse", Schema: s.env.Orders.Schema, Logger: s.env.Logger})
	if err != nil {
		return err
	}
	picked := saga.SignalOn(engine, SignalPicked, func(_ inbox.Message, ev WarehousePicked) (saga.Signal, error) {
		if ev.OrderID == "" {
			return saga.Signal{}, errors.New("WarehousePicked without order_id")
		}
		return saga.Signal{Saga: s.Checkout.Name(), BusinessKey: ev.OrderID}, nil
	})
	s.consume("orders", TopicWarehouse, "orders-warehouse", in, map[string]inbox.HandlerFunc{"WarehousePicked": picked}, nil)
	return nil
}
