package chaos

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// Report is what the checkers found. The first line of String is the one
// `make chaos` ends with; Violations lists what broke an invariant.
type Report struct {
	Sagas                int // orders and parcels the parent started
	Terminal             int // sagas completed, compensated or failed
	Lost                 int // orders started with no saga, or whose saga has no trace in the ledger it must have
	DBEffectsDoubled     int // (order, step, direction) with more than one ledger row
	ExternalCallsDeduped int // calls the external service answered from its idempotency keys
	Stuck                int // sagas not terminal at the deadline
	DeadLettered         int // distinct messages dead-lettered, by both consumers

	Completed, Compensated, Failed int
	// From the engine's history, for information: how often the faults made
	// the system re-drive a step or drop a duplicate.
	Rescued, Deduplicated int
	Inconsistent          int // a saga whose ledger or external calls do not match its end
	Stray                 int // a ledger row or external call of no started order
	KafkaMissing          int // outbox rows marked published that are not on the topics
	KafkaPhantom          int // messages on the topics that no outbox row and no injection explains

	// Bad messages written straight to the topics (see InjectPoison).
	PoisonInjected  int
	PoisonMissed    int // one that must be dead-lettered and is not
	PoisonProcessed int // a copy of a real message, processed as the duplicate it is
	BytesChanged    int // a dead letter of an injected message whose key, value or headers are not the bytes sent
	DeadUnexplained int // a dead letter of no injected message and no foreign saga: a valid message dead-lettered
	// PoisonOutcomes counts, per kind of injected message (see
	// InjectPoison), how many were dead-lettered and how many processed.
	PoisonOutcomes map[string]*Outcome

	// Commands no engine can run yet: of a saga type no engine registers
	// (Foreign: each must be parked), or of a saga another transaction
	// holds. Held counts the times engines moved one back to the outbox.
	Foreign, ForeignParked, Held int

	// Operator cancels: requests accepted, applied (Cancelled) or refused
	// because the saga had finished or was compensating already; a request
	// neither, or one whose saga's end contradicts it, is CancelBroken.
	Cancels, Cancelled, CancelRefused, CancelBroken int

	// DBErrors counts step attempts that PostgreSQL failed (a unique
	// violation or a division by zero through the step's transaction).
	DBErrors int
	// StallsCut counts reserve attempts that failed with step_timeout: a
	// Stall order's statement cut on the server by its step's Timeout.
	StallsCut int
	// Overran counts handlers abandoned past HandlerGrace: every handler
	// of the workload honours its context, and a statement must be cut
	// when its step's context ends, so none should be; a node frozen
	// (SIGSTOP, in the soak) between a step's deadline and its cut may
	// make one.
	Overran int
	// Uncut is Overran where no node is frozen (the crash matrix), where
	// it breaks an invariant.
	Uncut int

	// The parcels, sagas that wait (see ParcelDefinitions); they count in
	// Sagas, Terminal, Lost, Stuck and Inconsistent too.
	Parcels, ParcelsCompleted, ParcelsCompensated, ParcelsStuck int
	// From the history: the parcels' timers fired, signals received and
	// children ended. Each happens once per parcel that ended.
	TimersFired, SignalsReceived, ChildrenEnded int
	// TimerLateMax is the most a parcel's timer fired after its time, by
	// the database's clock, in milliseconds (a crash delays a timer; it
	// must not lose it).
	TimerLateMax int
	// WaitsDoubled counts the parcels whose timer fired, signal was
	// received or child ended more than once, or whose signal was recorded
	// more than once.
	WaitsDoubled int
	// The signallers' sends that the engine acknowledged, and how many of
	// them it recognised as duplicates (a second send of a signal ID);
	// SignalsRejected counts parcels' signals recorded as rejected (none
	// may be: every parcel waits for its signal).
	SignalsSent, SignalDuplicates, SignalsRejected int

	// NotRedelivered counts, over NATS, the messages a node held
	// unacknowledged when it was killed that no other node acknowledged
	// later (see RunSoak).
	NotRedelivered int

	Violations []string
	// Failures lists (the first 20) sagas that failed for good, which this
	// workload's never should but which break no invariant.
	Failures []string
	// BusState, when messages marked published are missing from NATS,
	// holds each stream's state and what the nats-server said of its
	// store on each start.
	BusState []string
}

// Outcome is what became of the injected messages of one kind.
type Outcome struct{ Dead, Processed int }

// PoisonLine lists, per kind of injected message, how many were
// dead-lettered and how many processed.
func (r *Report) PoisonLine() string {
	kinds := slices.Sorted(maps.Keys(r.PoisonOutcomes))
	parts := make([]string, 0, len(kinds))
	for _, k := range kinds {
		o := r.PoisonOutcomes[k]
		parts = append(parts, fmt.Sprintf("%s=%d/%d", k, o.Dead, o.Processed))
	}
	return "poison dead/processed: " + strings.Join(parts, " ")
}

// OK reports whether every invariant held.
func (r *Report) OK() bool {
	return r.Lost == 0 && r.DBEffectsDoubled == 0 && r.Stuck == 0 && r.Inconsistent == 0 && r.Stray == 0 &&
		r.WaitsDoubled == 0 && r.SignalsRejected == 0 &&
		r.KafkaMissing == 0 && r.KafkaPhantom == 0 && r.PoisonMissed == 0 && r.BytesChanged == 0 && r.DeadUnexplained == 0 &&
		r.ForeignParked == r.Foreign && r.CancelBroken == 0 && r.Terminal == r.Sagas && r.NotRedelivered == 0 && r.Uncut == 0
}

// Line is the one-line summary.
func (r *Report) Line() string {
	return fmt.Sprintf("sagas=%d terminal=%d lost=%d db_effects_doubled=%d external_calls_deduped=%d stuck=%d dead_lettered=%d",
		r.Sagas, r.Terminal, r.Lost, r.DBEffectsDoubled, r.ExternalCallsDeduped, r.Stuck, r.DeadLettered)
}

// WaitLine is the parcels' line: how they ended and what their waits did.
func (r *Report) WaitLine() string {
	return fmt.Sprintf("parcels=%d completed=%d compensated=%d stuck=%d timers_fired=%d timer_late_max_ms=%d signals_received=%d children_ended=%d "+
		"waits_doubled=%d signals_sent=%d signal_duplicates=%d signals_rejected=%d",
		r.Parcels, r.ParcelsCompleted, r.ParcelsCompensated, r.ParcelsStuck, r.TimersFired, r.TimerLateMax, r.SignalsReceived, r.ChildrenEnded,
		r.WaitsDoubled, r.SignalsSent, r.SignalDuplicates, r.SignalsRejected)
}

// Detail is the second line: how the sagas ended and the other checks.
func (r *Report) Detail() string {
	return fmt.Sprintf("completed=%d compensated=%d failed=%d inconsistent=%d stray=%d kafka_missing=%d kafka_phantom=%d rescued=%d deduplicated=%d "+
		"poison_injected=%d poison_missed=%d poison_processed=%d bytes_changed=%d dead_unexplained=%d "+
		"foreign=%d foreign_parked=%d held=%d cancels=%d cancelled=%d cancel_refused=%d cancel_broken=%d db_errors=%d stalls_cut=%d overran=%d",
		r.Completed, r.Compensated, r.Failed, r.Inconsistent, r.Stray, r.KafkaMissing, r.KafkaPhantom, r.Rescued, r.Deduplicated,
		r.PoisonInjected, r.PoisonMissed, r.PoisonProcessed, r.BytesChanged, r.DeadUnexplained,
		r.Foreign, r.ForeignParked, r.Held, r.Cancels, r.Cancelled, r.CancelRefused, r.CancelBroken, r.DBErrors, r.StallsCut, r.Overran)
}

func (r *Report) violate(format string, args ...any) {
	if len(r.Violations) < 50 {
		r.Violations = append(r.Violations, fmt.Sprintf(format, args...))
	}
}

// failure lists a saga that failed for good: not an invariant broken, but
// listed apart from Violations, so that many of them (a loaded machine's
// reply timeouts) do not crowd out the invariants a report must show.
func (r *Report) failure(format string, args ...any) {
	if len(r.Failures) < 20 {
		r.Failures = append(r.Failures, fmt.Sprintf(format, args...))
	}
}

// deadLettered counts the messages both consumers dead-lettered, by distinct
// Kafka position: a message redelivered after a crash may be dead-lettered
// twice.
const deadLettered = `SELECT count(DISTINCT (topic, kafka_partition, kafka_offset)) FROM (
    SELECT topic, kafka_partition, kafka_offset FROM ` + OrdersSchema + `.dead_letters
    UNION ALL SELECT topic, kafka_partition, kafka_offset FROM ` + PaymentsSchema + `.dead_letters) d`

type sagaRow struct {
	id, status, lastError string
}

// Check runs the checkers. It trusts the engine's tables only for each
// saga's final status; the effects come from the ledger (written by the step
// bodies, no unique key), the external service's own counts, and a reader of
// the topics that knows nothing of the engine.
func (e *Env) Check(ctx context.Context) (*Report, error) {
	r := &Report{}
	started := e.startedCopy()
	e.mu.Lock()
	parcels := maps.Clone(e.parcels)
	injected := slices.Clone(e.injected)
	foreign := maps.Clone(e.foreign)
	cancels := maps.Clone(e.cancels)
	e.mu.Unlock()
	r.Sagas = len(started) + len(parcels)
	r.Parcels = len(parcels)
	r.PoisonInjected = len(injected)
	r.Foreign = len(foreign)

	sagas := map[string]sagaRow{}
	rows, err := e.Pool.Query(ctx, "SELECT coalesce(business_key, id::text), id::text, status, coalesce(last_error_code, '') || ': ' || coalesce(last_error, '') FROM "+OrdersSchema+".saga_instances")
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var key, id, status, lastError string
		if err := rows.Scan(&key, &id, &status, &lastError); err != nil {
			return nil, err
		}
		sagas[key] = sagaRow{id, status, lastError}
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}

	// The ledger: (order, step, direction) -> rows.
	ledger := map[string]int{}
	rows, err = e.Pool.Query(ctx, "SELECT order_key, step, direction, count(*) FROM "+Ledger()+" GROUP BY 1, 2, 3")
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var key, step, dir string
		var n int
		if err := rows.Scan(&key, &step, &dir, &n); err != nil {
			return nil, err
		}
		ledger[key+"/"+step+"/"+dir] = n
		_, isParcel := parcels[key]
		if _, ok := started[key]; !ok && !isParcel {
			r.Stray++
			r.violate("ledger rows for %q, which no one ordered", key)
		}
		if n > 1 {
			r.DBEffectsDoubled++
			r.violate("%s %s/%s: %d ledger rows", key, step, dir, n)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}

	ids := map[string]bool{}
	for _, s := range sagas {
		ids[s.id] = true
	}
	calls := e.Service.Effects()
	applied := map[string]bool{} // op + " " + order key
	for k, n := range calls {
		r.ExternalCallsDeduped += n - 1
		op, key, _ := strings.Cut(k, " ")
		sk, err := steps.ParseKey(key)
		if err != nil || !ids[sk.SagaID.String()] {
			r.Stray++
			r.violate("external call %s under key %q, of no saga", op, key)
			continue
		}
		applied[op+" "+sk.SagaID.String()+"/"+sk.Step+"/"+string(sk.Direction)] = true
	}

	for key := range started {
		s, ok := sagas[key]
		if !ok {
			r.Lost++
			r.violate("%s: started, but there is no saga", key)
			continue
		}
		f := func(step string, dir steps.Direction) int { return ledger[key+"/"+step+"/"+string(dir)] }
		switch s.status {
		case "completed":
			r.Completed++
			if started[key].DBFatal {
				r.Inconsistent++
				r.violate("%s completed, but its ship step can only fail", key)
			}
			ok := f("reserve", steps.Forward) == 1 && f("charge", steps.Forward) == 1 && f("ship", steps.Forward) == 1 &&
				f("reserve", steps.Compensate) == 0 && f("charge", steps.Compensate) == 0 &&
				applied["bank/charge "+s.id+"/charge/forward"] && applied["carrier "+s.id+"/ship/forward"]
			if !ok {
				if f("reserve", steps.Forward)+f("charge", steps.Forward)+f("ship", steps.Forward) == 0 {
					r.Lost++
				} else {
					r.Inconsistent++
				}
				r.violate("%s completed but ledger has reserve=%d/%d charge=%d/%d ship=%d, bank=%v carrier=%v", key,
					f("reserve", steps.Forward), f("reserve", steps.Compensate), f("charge", steps.Forward), f("charge", steps.Compensate),
					f("ship", steps.Forward), applied["bank/charge "+s.id+"/charge/forward"], applied["carrier "+s.id+"/ship/forward"])
			}
		case "compensated":
			r.Compensated++
			if f("ship", steps.Forward) != 0 || f("reserve", steps.Forward) != f("reserve", steps.Compensate) ||
				f("charge", steps.Forward) != f("charge", steps.Compensate) {
				r.Inconsistent++
				r.violate("%s compensated but ledger has reserve=%d/%d charge=%d/%d ship=%d", key,
					f("reserve", steps.Forward), f("reserve", steps.Compensate), f("charge", steps.Forward), f("charge", steps.Compensate), f("ship", steps.Forward))
			}
		case "failed":
			// Terminal, for an operator to look at: a compensation that
			// failed for good. Listed, since this workload's never should.
			r.Failed++
			r.failure("%s failed: %s", key, s.lastError)
		default:
			r.Stuck++
			r.violate("%s (saga %s) is still %s", key, s.id, s.status)
			continue
		}
		r.Terminal++
	}

	if err := e.checkParcels(ctx, r, parcels, sagas, ledger); err != nil {
		return nil, err
	}

	// Dead letters: distinct Kafka positions, over both consumers.
	err = e.Pool.QueryRow(ctx, deadLettered).Scan(&r.DeadLettered)
	if err != nil {
		return nil, err
	}
	if err := e.checkDeadLetters(ctx, r, injected, foreign); err != nil {
		return nil, err
	}
	if err := e.checkCancels(ctx, r, cancels, sagas); err != nil {
		return nil, err
	}

	err = e.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE event = 'saga_rescued'), count(*) FILTER (WHERE event = 'step_deduplicated'),
	        count(*) FILTER (WHERE event = 'step_failed' AND (error_code = $1 OR error LIKE '%SQLSTATE 23505%')),
	        count(*) FILTER (WHERE event = 'step_failed' AND step_name = 'reserve' AND error_code = $2),
	        count(*) FILTER (WHERE error_code = $3)
	    FROM `+OrdersSchema+`.saga_history`, CodeDBData, saga.CodeTimeout, saga.CodeAbandonedRunOn).
		Scan(&r.Rescued, &r.Deduplicated, &r.DBErrors, &r.StallsCut, &r.Overran)
	if err != nil {
		return nil, err
	}
	err = e.Pool.QueryRow(ctx, `SELECT count(*) FROM `+OrdersSchema+`.outbox WHERE aggregatetype = 'sagaflow.held'`).Scan(&r.Held)
	if err != nil {
		return nil, err
	}
	if err := e.checkKafka(ctx, r, injected); err != nil {
		return nil, err
	}
	return r, nil
}

// position is a message's place in Kafka.
type position struct {
	topic     string
	partition int32
	offset    int64
}

// checkDeadLetters accounts for every dead letter and every injected
// message: an injected message that must be dead-lettered is, with the
// bytes that were sent; a copy that may be processed either is
// dead-lettered or changed nothing (the ledger checks); a foreign saga's
// command is parked; and nothing else is dead-lettered.
func (e *Env) checkDeadLetters(ctx context.Context, r *Report, injected []Injected, foreign map[string]uuid.UUID) error {
	byPos := map[position]Injected{}
	for _, in := range injected {
		byPos[position{in.Topic, in.Partition, in.Offset}] = in
	}
	foreignIDs := map[string]bool{}
	for _, id := range foreign {
		foreignIDs[id.String()] = true
	}
	dead := map[position]bool{}
	parked := map[string]bool{}
	for _, schema := range []string{OrdersSchema, PaymentsSchema} {
		rows, err := e.Pool.Query(ctx, `SELECT consumer, topic, kafka_partition, kafka_offset, coalesce(msg_key, ''), coalesce(msg_value, ''),
		        coalesce(raw_headers, '[]')::text, coalesce(headers->>'sagaflow-saga-id', ''), reason
		    FROM `+schema+`.dead_letters WHERE kafka_offset IS NOT NULL`)
		if err != nil {
			return err
		}
		for rows.Next() {
			var consumer, reason, sagaID, rawHeaders string
			var p position
			var key, value []byte
			if err := rows.Scan(&consumer, &p.topic, &p.partition, &p.offset, &key, &value, &rawHeaders, &sagaID, &reason); err != nil {
				rows.Close()
				return err
			}
			dead[p] = true
			in, ok := byPos[p]
			switch {
			case ok:
				if why := sameBytes(in.record, key, value, rawHeaders); why != "" {
					r.BytesChanged++
					r.violate("dead letter of %s at %s/%d/%d: %s", in.Kind, p.topic, p.partition, p.offset, why)
				}
			case schema == OrdersSchema && strings.HasPrefix(reason, saga.CodeUnknownSaga+":") && foreignIDs[sagaID]:
				parked[sagaID] = true
			default:
				r.DeadUnexplained++
				r.violate("a message no one injected was dead-lettered by %s at %s/%d/%d: %s", consumer, p.topic, p.partition, p.offset,
					safetext.Text(reason, 300))
			}
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
	}
	r.PoisonOutcomes = map[string]*Outcome{}
	for _, in := range injected {
		kind, _, _ := strings.Cut(in.Kind, "/")
		if !in.Must {
			kind += "(may)"
		}
		o := r.PoisonOutcomes[kind]
		if o == nil {
			o = &Outcome{}
			r.PoisonOutcomes[kind] = o
		}
		switch {
		case dead[position{in.Topic, in.Partition, in.Offset}]:
			o.Dead++
		case in.Must:
			r.PoisonMissed++
			r.violate("%s at %s/%d/%d was not dead-lettered", in.Kind, in.Topic, in.Partition, in.Offset)
		default:
			o.Processed++
			r.PoisonProcessed++
		}
	}
	// A foreign saga's command that was never on Kafka (the hybrid mode's
	// direct commands) is parked in the outbox (see parkedForeign).
	rows, err := e.Pool.Query(ctx, `SELECT saga_id FROM (`+parkedForeign+`) f`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return err
		}
		if foreignIDs[id] {
			parked[id] = true
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	r.ForeignParked = len(parked)
	for key, id := range foreign {
		if !parked[id.String()] {
			r.violate("foreign saga %s (%s): its command was not parked%s", key, id, e.foreignTrail(ctx, id))
		}
	}
	return nil
}

// sameBytes compares a dead letter's key, value and raw headers with the
// record that was sent; it returns what differs, or "".
func sameBytes(sent *kgo.Record, key, value []byte, rawHeaders string) string {
	if sent == nil {
		return ""
	}
	if !bytes.Equal(key, sent.Key) {
		return fmt.Sprintf("key of %d bytes stored for %d sent", len(key), len(sent.Key))
	}
	if !bytes.Equal(value, sent.Value) {
		return fmt.Sprintf("value of %d bytes stored for %d sent", len(value), len(sent.Value))
	}
	hs, err := store.DecodeRawHeaders(rawHeaders)
	if err != nil {
		return "raw headers: " + err.Error()
	}
	if len(hs) != len(sent.Headers) {
		return fmt.Sprintf("%d raw headers stored for %d sent", len(hs), len(sent.Headers))
	}
	for i, h := range hs {
		if string(h.Key) != sent.Headers[i].Key || !bytes.Equal(h.Value, sent.Headers[i].Value) {
			return fmt.Sprintf("raw header %d differs", i)
		}
	}
	return ""
}

// checkCancels checks the operator's cancels: an accepted request was
// applied (the saga compensated, every completed step's effect undone: the
// ledger checks) or refused because the saga had finished or was
// compensating already; a completed saga's request can only be refused;
// and no request is left pending.
func (e *Env) checkCancels(ctx context.Context, r *Report, cancels map[string]CancelDone, sagas map[string]sagaRow) error {
	type events struct{ cancelled, refused int }
	got := map[string]events{}
	rows, err := e.Pool.Query(ctx, `SELECT saga_id::text, count(*) FILTER (WHERE event = $1), count(*) FILTER (WHERE event = $2)
	    FROM `+OrdersSchema+`.saga_history WHERE event IN ($1, $2) GROUP BY 1`, saga.EventSagaCancelled, saga.EventCancelRefused)
	if err != nil {
		return err
	}
	for rows.Next() {
		var id string
		var ev events
		if err := rows.Scan(&id, &ev.cancelled, &ev.refused); err != nil {
			rows.Close()
			return err
		}
		got[id] = ev
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	var pending int
	if err := e.Pool.QueryRow(ctx, `SELECT count(*) FROM `+OrdersSchema+`.saga_cancel_requests`).Scan(&pending); err != nil {
		return err
	}
	if pending > 0 {
		r.CancelBroken += pending
		r.violate("%d cancel requests are still pending", pending)
	}
	for key, c := range cancels {
		if !c.Accepted {
			continue
		}
		r.Cancels++
		s, ok := sagas[key]
		if !ok {
			continue // counted as lost
		}
		ev := got[s.id]
		if ev.cancelled > 0 {
			r.Cancelled++
		}
		if ev.refused > 0 {
			r.CancelRefused++
		}
		switch {
		case ev.cancelled+ev.refused == 0:
			r.CancelBroken++
			r.violate("%s (%s): the cancel request was neither applied nor refused; the saga is %s", key, c.How, s.status)
		case ev.cancelled > 0 && s.status != "compensated":
			r.CancelBroken++
			r.violate("%s (%s): cancelled, but the saga is %s", key, c.How, s.status)
		case s.status == "completed" && ev.refused == 0:
			r.CancelBroken++
			r.violate("%s (%s): completed with its cancel request not refused", key, c.How)
		}
	}
	return nil
}

// checkKafka compares what reached the topics, read partition by partition
// with a plain connection (over NATS: every stream, by sequence, from the
// server's store), with the outbox rows marked published.
//
// The system may still be publishing (a participant answering a command
// whose saga already ended, say), so the outbox is read twice: the rows
// marked published before the topics are read must all be on them (a row
// is marked only after the broker acknowledged it), and every message on
// the topics must have a row once they have been read. Reading the outbox
// once, after the topics, counted rows published in between as missing.
func (e *Env) checkKafka(ctx context.Context, r *Report, injected []Injected) error {
	poison := map[position]bool{}
	for _, in := range injected {
		poison[position{in.Topic, in.Partition, in.Offset}] = true
	}
	before, err := e.relayRows(ctx)
	if err != nil {
		return err
	}
	onTopics := map[string]bool{}
	var streams []string
	for _, topic := range Topics() {
		var msgs []kafka.Message
		var err error
		if e.Bus == BusNATS {
			var state string
			msgs, state, err = e.readNATSTopic(ctx, topic, func(p int, seq uint64) bool { return poison[position{topic, int32(p), int64(seq)}] })
			streams = append(streams, state)
		} else {
			msgs, err = e.Kafka.ReadAll(ctx, topic)
		}
		if err != nil {
			return err
		}
		for _, m := range msgs {
			id := ""
			for _, h := range m.Headers {
				if h.Key == store.HeaderMessageID {
					id = string(h.Value)
				}
			}
			if poison[position{m.Topic, int32(m.Partition), m.Offset}] {
				continue
			}
			if id == "" {
				r.KafkaPhantom++
				r.violate("a message with no id at %s/%d/%d, not injected", m.Topic, m.Partition, m.Offset)
				continue
			}
			onTopics[id] = true
		}
	}
	after, err := e.relayRows(ctx)
	if err != nil {
		return err
	}
	missing := map[string]int{} // by schema and topic
	var missingRows []string
	for _, row := range before {
		if row.status != "published" || onTopics[row.id] {
			continue
		}
		r.KafkaMissing++
		at := "?"
		if row.published != nil {
			at = row.published.UTC().Format("15:04:05.000")
		}
		line := fmt.Sprintf("outbox row %s (%s, topic %s, written %s, marked published %s, attempts %d, last error %q) is marked published but is on no topic",
			row.id, row.schema, row.topic, row.created.UTC().Format("15:04:05.000"), at, row.attempts, safetext.Text(row.lastErr, 200))
		r.violate("%s", line)
		missing[row.schema+" "+row.topic]++
		if len(missingRows) < 30 {
			missingRows = append(missingRows, line)
		}
	}
	inOutbox := map[string]bool{}
	for _, row := range after {
		inOutbox[row.id] = true
	}
	var phantoms []string
	for id := range onTopics {
		if !inOutbox[id] {
			phantoms = append(phantoms, id)
		}
	}
	slices.Sort(phantoms)
	r.KafkaPhantom = len(phantoms)
	for _, id := range phantoms {
		r.violate("message %s is on a topic but in no outbox", id)
	}
	if r.KafkaMissing > 0 && e.Bus == BusNATS {
		for _, k := range slices.Sorted(maps.Keys(missing)) {
			r.BusState = append(r.BusState, fmt.Sprintf("missing from %s: %d rows", k, missing[k]))
		}
		r.BusState = append(r.BusState, missingRows...)
		r.BusState = append(r.BusState, streams...)
		r.BusState = append(r.BusState, e.natsRecovery()...)
	}
	return nil
}

// relayRow is an outbox row the relays publish, as checkKafka reads it.
type relayRow struct {
	id, schema, topic, status, lastErr string
	created                            time.Time
	published                          *time.Time
	attempts                           int
}

// relayRows reads the relay rows of both outboxes.
func (e *Env) relayRows(ctx context.Context) ([]relayRow, error) {
	var out []relayRow
	for _, schema := range []string{OrdersSchema, PaymentsSchema} {
		rows, err := e.Pool.Query(ctx, "SELECT id::text, status, topic, created_at, published_at, attempts, coalesce(last_error, '') FROM "+
			schema+".outbox WHERE delivery = 'relay'")
		if err != nil {
			return nil, err
		}
		for rows.Next() {
			row := relayRow{schema: schema}
			if err := rows.Scan(&row.id, &row.status, &row.topic, &row.created, &row.published, &row.attempts, &row.lastErr); err != nil {
				rows.Close()
				return nil, err
			}
			out = append(out, row)
		}
		if err := rows.Err(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// foreignTrail describes what became of a foreign saga's commands, for a
// violation: its history, its outbox rows and every engine dead letter
// that names it.
func (e *Env) foreignTrail(ctx context.Context, id uuid.UUID) string {
	var b strings.Builder
	q := func(title, sql string) {
		rows, err := e.Pool.Query(ctx, sql, id)
		if err != nil {
			fmt.Fprintf(&b, "\n  %s: %v", title, err)
			return
		}
		defer rows.Close()
		for rows.Next() {
			var line string
			if err := rows.Scan(&line); err == nil {
				fmt.Fprintf(&b, "\n  %s: %s", title, safetext.Text(line, 400))
			}
		}
	}
	q("history", `SELECT event || ' ' || coalesce(error_code, '') || ' ' || coalesce(detail::text, '') || ' at ' || at FROM `+OrdersSchema+`.saga_history WHERE saga_id = $1 ORDER BY id`)
	q("outbox", `SELECT id || ' ' || status || ' ' || topic || ' ' || headers::text || ' ' || created_at FROM `+OrdersSchema+`.outbox WHERE saga_id = $1 ORDER BY created_at`)
	q("dead letter", `SELECT topic || '/' || kafka_partition || '/' || kafka_offset || ' ' || left(reason, 120) || ' ' || headers::text FROM `+OrdersSchema+`.dead_letters WHERE headers->>'sagaflow-saga-id' = $1::text OR position(convert_to($1::text, 'UTF8') in msg_value) > 0`)
	return b.String()
}

// checkParcels checks the sagas that wait: a parcel completed with every
// step's ledger row once (the step after the timer, the signal's handler,
// the child's step and the step after it), or, if its child had to fail,
// compensated with its first step undone and nothing after the child; its
// timer fired once, its signal was received once and its child ended
// once, by the history; its signal is recorded once, delivered, however
// often it was sent.
func (e *Env) checkParcels(ctx context.Context, r *Report, parcels map[string]Parcel, sagas map[string]sagaRow, ledger map[string]int) error {
	waits := map[string]int{} // business key + " " + event -> count
	rows, err := e.Pool.Query(ctx, `SELECT s.business_key, h.event, count(*) FROM `+OrdersSchema+`.saga_history h
	    JOIN `+OrdersSchema+`.saga_instances s ON s.id = h.saga_id
	    WHERE s.saga_name = $1 AND h.event IN ($2, $3, $4) GROUP BY 1, 2`,
		ParcelSagaName, saga.EventTimerFired, saga.EventSignalReceived, saga.EventChildEnded)
	if err != nil {
		return err
	}
	for rows.Next() {
		var key, event string
		var n int
		if err := rows.Scan(&key, &event, &n); err != nil {
			rows.Close()
			return err
		}
		waits[key+" "+event] = n
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	signals := map[string][]string{} // business key -> statuses of its signals
	rows, err = e.Pool.Query(ctx, `SELECT s.business_key, g.status FROM `+OrdersSchema+`.saga_signals g
	    JOIN `+OrdersSchema+`.saga_instances s ON s.id = g.saga_id WHERE s.saga_name = $1`, ParcelSagaName)
	if err != nil {
		return err
	}
	for rows.Next() {
		var key, status string
		if err := rows.Scan(&key, &status); err != nil {
			rows.Close()
			return err
		}
		signals[key] = append(signals[key], status)
		if status == "rejected" {
			r.SignalsRejected++
			r.violate("parcel %s: its signal was rejected", key)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	err = e.Pool.QueryRow(ctx, `SELECT coalesce(sum(sends), 0), coalesce(sum(duplicates), 0) FROM `+signalRequests()).
		Scan(&r.SignalsSent, &r.SignalDuplicates)
	if err != nil {
		return err
	}
	err = e.Pool.QueryRow(ctx, `SELECT coalesce(max((h.detail->>'late_ms')::bigint), 0) FROM `+OrdersSchema+`.saga_history h
	    JOIN `+OrdersSchema+`.saga_instances s ON s.id = h.saga_id WHERE s.saga_name = $1 AND h.event = $2`,
		ParcelSagaName, saga.EventTimerFired).Scan(&r.TimerLateMax)
	if err != nil {
		return err
	}

	for key, p := range parcels {
		s, ok := sagas[key]
		if !ok {
			r.Lost++
			r.violate("parcel %s: started, but there is no saga", key)
			continue
		}
		f := func(step string, dir steps.Direction) int { return ledger[key+"/"+step+"/"+string(dir)] }
		fwd := func(step string) int { return f(step, steps.Forward) }
		trail := fmt.Sprintf("pack=%d/%d stamp=%d box=%d/%d invoice=%d/%d picked=%d print=%d label=%d ship=%d", fwd("pack"), f("pack", steps.Compensate),
			fwd("stamp"), fwd("box"), f("box", steps.Compensate), fwd("invoice"), f("invoice", steps.Compensate),
			fwd("picked"), fwd("print"), fwd("label"), fwd("ship"))
		// The parallel step's branches: each once, compensated once when the
		// parcel compensates; absent in Kafka mode.
		branches := 1
		if e.AllSteps {
			branches = 0
		}
		branchesOK := func(comp int) bool {
			return fwd("box") == branches && fwd("invoice") == branches &&
				f("box", steps.Compensate) == comp*branches && f("invoice", steps.Compensate) == comp*branches
		}
		switch s.status {
		case "completed":
			r.Completed++
			r.ParcelsCompleted++
			ok := !p.ChildFail && fwd("pack") == 1 && f("pack", steps.Compensate) == 0 && fwd("stamp") == 1 && fwd("picked") == 1 &&
				fwd("print") == 1 && fwd("label") == 1 && fwd("ship") == 1 && branchesOK(0)
			if !ok {
				if fwd("pack")+fwd("stamp")+fwd("picked")+fwd("print")+fwd("label")+fwd("ship") == 0 {
					r.Lost++
				} else {
					r.Inconsistent++
				}
				r.violate("parcel %s (child fails: %v) completed but ledger has %s", key, p.ChildFail, trail)
			}
		case "compensated":
			r.Compensated++
			r.ParcelsCompensated++
			ok := p.ChildFail && fwd("pack") == 1 && f("pack", steps.Compensate) == 1 && fwd("stamp") == 1 && fwd("picked") == 1 &&
				fwd("print") == 0 && fwd("label") == 0 && fwd("ship") == 0 && branchesOK(1)
			if !ok {
				r.Inconsistent++
				r.violate("parcel %s (child fails: %v) compensated (%s) but ledger has %s", key, p.ChildFail, s.lastError, trail)
			}
		case "failed":
			r.Failed++
			r.failure("parcel %s failed: %s", key, s.lastError)
		default:
			r.Stuck++
			r.ParcelsStuck++
			r.violate("parcel %s (saga %s) is still %s; ledger has %s; signals %v", key, s.id, s.status, trail, signals[key])
			continue
		}
		r.Terminal++
		for _, ev := range []string{saga.EventTimerFired, saga.EventSignalReceived, saga.EventChildEnded} {
			n := waits[key+" "+ev]
			switch {
			case n > 1:
				r.WaitsDoubled++
				r.violate("parcel %s: %d %s events", key, n, ev)
			case n == 0:
				r.Inconsistent++
				r.violate("parcel %s ended %s with no %s event", key, s.status, ev)
			}
		}
		r.TimersFired += waits[key+" "+saga.EventTimerFired]
		r.SignalsReceived += waits[key+" "+saga.EventSignalReceived]
		r.ChildrenEnded += waits[key+" "+saga.EventChildEnded]
		switch {
		case len(signals[key]) > 1:
			r.WaitsDoubled++
			r.violate("parcel %s: its signal is recorded %d times: %v", key, len(signals[key]), signals[key])
		case len(signals[key]) == 0 || signals[key][0] != "delivered":
			r.Inconsistent++
			r.violate("parcel %s ended %s with its signal recorded as %v", key, s.status, signals[key])
		}
	}
	return nil
}
