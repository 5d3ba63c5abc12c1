package chaos

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/sagaflow/sagaflow/steps"
	"github.com/sagaflow/sagaflow/store"
)

// Report is what the checkers found. The first line of String is the one
// `make chaos` ends with; Violations lists what broke an invariant.
type Report struct {
	Sagas                int // orders the parent started
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
	PoisonInjected        int
	KafkaMissing          int // outbox rows marked published that are not on the topics
	KafkaPhantom          int // messages on the topics that no outbox row and no injection explains
	Violations            []string
}

// OK reports whether every invariant held.
func (r *Report) OK() bool {
	return r.Lost == 0 && r.DBEffectsDoubled == 0 && r.Stuck == 0 && r.Inconsistent == 0 &&
		r.KafkaMissing == 0 && r.KafkaPhantom == 0 && r.DeadLettered == r.PoisonInjected && r.Terminal == r.Sagas
}

// Line is the one-line summary.
func (r *Report) Line() string {
	return fmt.Sprintf("sagas=%d terminal=%d lost=%d db_effects_doubled=%d external_calls_deduped=%d stuck=%d dead_lettered=%d",
		r.Sagas, r.Terminal, r.Lost, r.DBEffectsDoubled, r.ExternalCallsDeduped, r.Stuck, r.DeadLettered)
}

// Detail is the second line: how the sagas ended and the other checks.
func (r *Report) Detail() string {
	return fmt.Sprintf("completed=%d compensated=%d failed=%d inconsistent=%d poison_injected=%d kafka_missing=%d kafka_phantom=%d rescued=%d deduplicated=%d",
		r.Completed, r.Compensated, r.Failed, r.Inconsistent, r.PoisonInjected, r.KafkaMissing, r.KafkaPhantom, r.Rescued, r.Deduplicated)
}

func (r *Report) violate(format string, args ...any) {
	if len(r.Violations) < 50 {
		r.Violations = append(r.Violations, fmt.Sprintf(format, args...))
	}
}

// deadLettered counts the messages both consumers dead-lettered, by distinct
// Kafka position: a message redelivered after a crash may be dead-lettered
// twice.
const deadLettered = `SELECT count(DISTINCT (topic, kafka_partition, kafka_offset)) FROM (
    SELECT topic, kafka_partition, kafka_offset FROM ` + OrdersSchema + `.dead_letters
    UNION ALL SELECT topic, kafka_partition, kafka_offset FROM ` + PaymentsSchema + `.dead_letters) d`

// Check runs the checkers. It trusts the engine's tables only for each
// saga's final status; the effects come from the ledger (written by the step
// bodies, no unique key), the external service's own counts, and a reader of
// the topics that knows nothing of the engine.
func (e *Env) Check(ctx context.Context) (*Report, error) {
	r := &Report{}
	started := e.startedCopy()
	e.mu.Lock()
	r.PoisonInjected = e.poison
	e.mu.Unlock()
	r.Sagas = len(started)

	type sagaRow struct {
		id, status, lastError string
	}
	sagas := map[string]sagaRow{}
	rows, err := e.Pool.Query(ctx, "SELECT business_key, id::text, status, coalesce(last_error_code, '') || ': ' || coalesce(last_error, '') FROM "+OrdersSchema+".saga_instances")
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
		if n > 1 {
			r.DBEffectsDoubled++
			r.violate("%s %s/%s: %d ledger rows", key, step, dir, n)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}

	calls := e.Service.Effects()
	applied := map[string]bool{} // op + " " + order key
	for k, n := range calls {
		r.ExternalCallsDeduped += n - 1
		op, key, _ := strings.Cut(k, " ")
		if sk, err := steps.ParseKey(key); err == nil {
			applied[op+" "+sk.SagaID.String()+"/"+sk.Step+"/"+string(sk.Direction)] = true
		}
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
			r.violate("%s failed: %s", key, s.lastError)
		default:
			r.Stuck++
			r.violate("%s (saga %s) is still %s", key, s.id, s.status)
			continue
		}
		r.Terminal++
	}

	// Dead letters: distinct Kafka positions, over both consumers.
	err = e.Pool.QueryRow(ctx, deadLettered).Scan(&r.DeadLettered)
	if err != nil {
		return nil, err
	}
	if r.DeadLettered != r.PoisonInjected {
		r.violate("%d messages dead-lettered, %d malformed ones injected", r.DeadLettered, r.PoisonInjected)
	}

	err = e.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE event = 'saga_rescued'), count(*) FILTER (WHERE event = 'step_deduplicated')
	    FROM `+OrdersSchema+`.saga_history`).Scan(&r.Rescued, &r.Deduplicated)
	if err != nil {
		return nil, err
	}
	if err := e.checkKafka(ctx, r); err != nil {
		return nil, err
	}
	return r, nil
}

// checkKafka compares what reached the topics, read partition by partition
// with a plain connection, with the outbox rows marked published.
func (e *Env) checkKafka(ctx context.Context, r *Report) error {
	onTopics := map[string]bool{}
	for _, topic := range Topics() {
		msgs, err := e.Kafka.ReadAll(ctx, topic)
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
			if id == "" || strings.HasPrefix(id, "poison-") || strings.HasPrefix(string(m.Key), "poison-") {
				continue
			}
			onTopics[id] = true
		}
	}
	inOutbox := map[string]bool{}
	for _, schema := range []string{OrdersSchema, PaymentsSchema} {
		rows, err := e.Pool.Query(ctx, "SELECT id::text, status FROM "+schema+".outbox WHERE delivery = 'relay'")
		if err != nil {
			return err
		}
		for rows.Next() {
			var id, status string
			if err := rows.Scan(&id, &status); err != nil {
				return err
			}
			inOutbox[id] = true
			if status == "published" && !onTopics[id] {
				r.KafkaMissing++
				r.violate("outbox row %s (%s) is marked published but is on no topic", id, schema)
			}
		}
		if err := rows.Err(); err != nil {
			return err
		}
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
	return nil
}
