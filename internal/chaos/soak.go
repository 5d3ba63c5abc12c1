package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"
)

// SoakConfig sizes a chaos soak.
type SoakConfig struct {
	Duration     time.Duration // how long the attacks go on
	Rate         float64       // sagas started per second meanwhile
	Engines      int           // engine nodes (the orders engine and its relay)
	Participants int           // participant nodes (payments and its relay)
	Seed         uint64
	Deadline     time.Duration // after the attacks, for every saga to end
	AllSteps     bool          // engines in Kafka mode instead of the hybrid mode
	// Bus is BusKafka (the default) or BusNATS. Over NATS the broker
	// outage kills the nats-server and starts it again on its store, and
	// nodes are also killed while they hold unacknowledged messages
	// (see RunSoak).
	Bus  string
	Logf func(format string, args ...any)
}

// SoakResult is a soak's report and what was done to the system.
type SoakResult struct {
	Report   *Report
	Actions  map[string]int
	Duration time.Duration
}

// ActionsLine lists the attacks made, by kind.
func (r *SoakResult) ActionsLine() string {
	kinds := make([]string, 0, len(r.Actions))
	for k := range r.Actions {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	parts := make([]string, 0, len(kinds))
	for _, k := range kinds {
		parts = append(parts, fmt.Sprintf("%s=%d", k, r.Actions[k]))
	}
	return strings.Join(parts, " ")
}

// RunSoak attacks a running system for cfg.Duration while orders keep
// coming: engine and participant nodes are killed with SIGKILL and started
// again, paused with SIGSTOP for longer than their group session and
// resumed, PostgreSQL is restarted without a checkpoint, the broker goes
// away for seconds at a time, a transaction is held open for a long time,
// bad messages are mixed into the topics, sagas of a type no engine knows
// are started, an operator cancels orders (some while a step runs), and
// parcels wait for timers, signals (sent by the engine nodes' signallers)
// and child sagas.
//
// Over NATS (cfg.Bus), the broker outage is the nats-server killed
// (SIGKILL) and started again on the same port and store 2-4 s later, and
// three attacks of each round (instead of one of the two plain SIGKILLs)
// kill a node while it holds messages it fetched and has not acknowledged
// (redelivery_kill): the node, alternately
// a participant and an engine, reports what it holds (see heldLog); once it
// holds something the parent stops it, reads the list again and kills it.
// Each message it held that its consumer had not acknowledged must then be
// redelivered by JetStream after the ack wait, to a surviving node or to
// the node started again, and acknowledged (redelivered counts them; the
// soak fails if one is not). Every other time, a node that took such a
// redelivered message is killed in turn while it holds it
// (redelivery_kill_again).
//
// Then every saga must end within cfg.Deadline, and the checkers run.
func RunSoak(ctx context.Context, dir string, nodeCmd NodeCommand, cfg SoakConfig) (*SoakResult, error) {
	began := time.Now()
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x5a6af10))
	env, err := NewEnv(ctx, dir, nodeCmd, cfg.AllSteps, cfg.Bus)
	if err != nil {
		return nil, err
	}
	defer env.Close()

	var slots []*slot
	for i := range cfg.Engines {
		slots = append(slots, &slot{name: fmt.Sprintf("engine-%d", i+1), roles: []string{RoleEngine, RoleRelayOrders, RoleSignals}})
	}
	for i := range cfg.Participants {
		slots = append(slots, &slot{name: fmt.Sprintf("participant-%d", i+1), roles: []string{RoleParticipant, RoleRelayPayments}})
	}
	for _, s := range slots {
		if s.node, err = env.StartNode(s.name, s.roles, ""); err != nil {
			return nil, err
		}
	}

	res := &SoakResult{Actions: map[string]int{}}
	var redo redeliveries
	attack, stopAttack := context.WithTimeout(ctx, cfg.Duration)
	defer stopAttack()
	var wg sync.WaitGroup
	var startErr error
	var errMu sync.Mutex

	// Orders arrive at cfg.Rate; each start retries through restarts.
	wg.Add(1)
	go func() {
		defer wg.Done()
		sem := make(chan struct{}, 16)
		tick := time.NewTicker(time.Duration(float64(time.Second) / cfg.Rate))
		defer tick.Stop()
		orderRng := rand.New(rand.NewPCG(cfg.Seed, 0x0dde5))
		for i := 0; ; i++ {
			select {
			case <-attack.Done():
				return
			case <-tick.C:
			}
			o := NewOrder(fmt.Sprintf("s-%06d", i), orderRng, 0.2, 0.005)
			switch p := orderRng.Float64(); {
			case p < 0.03:
				o.DBFail = 1 + orderRng.IntN(3)
			case p < 0.04:
				o.DBFatal = true
			case p < 0.05:
				o.Linger = true
			case p < 0.08:
				o.Dawdle = true
			case p < 0.09:
				o.Stall = true
			}
			// Operator cancels: every lingering order while its reserve
			// step runs, one order in 50 at a random moment as the CLI
			// does, one in 100 by a transaction that holds the saga for a
			// second.
			how, after := "", time.Duration(0)
			switch {
			case o.Linger:
				how, after = "cancel", time.Second
			case i%50 == 7:
				how, after = "request", time.Duration(orderRng.IntN(3000))*time.Millisecond
			case i%100 == 33:
				how = "held"
			}
			// One tick in six also starts a parcel, a saga that waits (see
			// ParcelDefinitions): its signal is sent 0-3 s later, every
			// other one twice; one in five has a child that fails.
			if i%6 == 3 {
				n := i / 6
				p := Parcel{Key: fmt.Sprintf("p-%06d", n), CoolMS: 200 + orderRng.IntN(800), ChildFail: n%5 == 4}
				after := time.Duration(orderRng.IntN(3000)) * time.Millisecond
				sem <- struct{}{}
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer func() { <-sem }()
					sctx, cancel := context.WithTimeout(ctx, time.Minute)
					defer cancel()
					if err := env.StartParcel(sctx, p, 1+n%2, after); err != nil {
						errMu.Lock()
						startErr = err
						errMu.Unlock()
					}
				}()
			}
			sem <- struct{}{}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				sctx, cancel := context.WithTimeout(ctx, time.Minute)
				defer cancel()
				err := env.Start(sctx, o)
				if err == nil && how != "" {
					time.Sleep(after)
					err = env.Cancel(sctx, o.Key, how)
				}
				if err != nil {
					errMu.Lock()
					startErr = err
					errMu.Unlock()
				}
			}()
		}
	}()

	sleep := func(d time.Duration) {
		select {
		case <-attack.Done():
		case <-time.After(d):
		}
	}
	ms := func(lo, hi int) time.Duration { return time.Duration(lo+rng.IntN(hi-lo+1)) * time.Millisecond }
	lastPoison := time.Now()
	var round []string
	for attack.Err() == nil {
		sleep(ms(1500, 4000))
		if attack.Err() != nil {
			break
		}
		if time.Since(lastPoison) > 8*time.Second {
			if err := env.InjectPoison(ctx, len(poisonKinds), rng); err != nil {
				return nil, err
			}
			res.Actions["poison"] += len(poisonKinds)
			if err := env.StartForeign(ctx, fmt.Sprintf("f-%03d", res.Actions["foreign"])); err != nil {
				return nil, err
			}
			res.Actions["foreign"]++
			lastPoison = time.Now()
		}
		// Every kind of attack once per round, in a random order.
		if len(round) == 0 {
			round = []string{"sigkill", "sigkill", "sigstop", "pg_restart", "broker_outage", "long_tx"}
			if env.Bus == BusNATS {
				// One plain SIGKILL becomes three kills of a node that
				// holds unacknowledged messages.
				round = append(round[1:], "redelivery_kill", "redelivery_kill", "redelivery_kill")
			}
			rng.Shuffle(len(round), func(i, j int) { round[i], round[j] = round[j], round[i] })
		}
		kind := round[0]
		round = round[1:]
		// Attack a system whose groups have settled (see WaitGroupsStable).
		settle, cancelSettle := context.WithTimeout(ctx, 2*time.Minute)
		err := env.WaitGroupsStable(settle, cfg.Engines, cfg.Participants)
		cancelSettle()
		if err != nil {
			return nil, err
		}
		s := slots[rng.IntN(len(slots))]
		switch kind {
		case "sigkill":
			cfg.Logf("chaos: SIGKILL %s", s.name)
			s.node.Kill()
			res.Actions["sigkill"]++
			time.Sleep(ms(200, 2000))
			if s.node, err = env.StartNode(s.name, s.roles, ""); err != nil {
				return nil, err
			}
		case "sigstop":
			cfg.Logf("chaos: SIGSTOP %s past its session", s.name)
			if err := s.node.Pause(); err != nil {
				return nil, err
			}
			res.Actions["sigstop"]++
			time.Sleep(2*SessionTimeout + ms(0, 1500))
			if err := s.node.Resume(); err != nil {
				return nil, err
			}
		case "pg_restart":
			cfg.Logf("chaos: PostgreSQL immediate restart")
			if err := env.PG.Kill(); err != nil {
				return nil, err
			}
			time.Sleep(ms(0, 1000))
			if err := env.PG.Restart(ctx); err != nil {
				return nil, err
			}
			res.Actions["pg_restart"]++
		case "broker_outage":
			if env.Bus == BusNATS {
				d := ms(2000, 4000)
				cfg.Logf("chaos: nats-server killed at %s, started again in %s", time.Now().UTC().Format("15:04:05.000"), d)
				env.NATS.Kill()
				time.Sleep(d)
				if err := env.NATS.StartAgain(); err != nil {
					return nil, err
				}
				res.Actions["broker_outage"]++
				break
			}
			d := ms(1000, 5000)
			cfg.Logf("chaos: broker unreachable for %s", d)
			outage := env.Kafka.Unreachable()
			time.Sleep(d)
			outage.Remove()
			res.Actions["broker_outage"]++
		case "redelivery_kill":
			role := RoleParticipant
			if res.Actions["redelivery_kill"]%2 == 1 {
				role = RoleEngine
			}
			var of []*slot
			for _, s := range slots {
				if slices.Contains(s.roles, role) {
					of = append(of, s)
				}
			}
			if err := redeliveryKill(ctx, env, cfg, rng, of, res, &redo); err != nil {
				return nil, err
			}
		case "long_tx":
			d := ms(5000, 15000)
			cfg.Logf("chaos: a transaction held open for %s", d)
			res.Actions["long_tx"]++
			wg.Add(1)
			go func() {
				defer wg.Done()
				holdTransaction(ctx, env, d)
			}()
		}
	}
	wg.Wait()
	errMu.Lock()
	err = startErr
	errMu.Unlock()
	if err != nil {
		return nil, err
	}
	env.mu.Lock()
	parcels := len(env.parcels)
	env.mu.Unlock()
	cfg.Logf("chaos: attacks over after %s; %d orders and %d parcels started; waiting for every saga to end", time.Since(began).Round(time.Second),
		len(env.startedCopy()), parcels)
	wctx, cancel := context.WithTimeout(ctx, cfg.Deadline)
	defer cancel()
	_ = env.WaitTerminal(wctx) // what did not end is counted as stuck
	if res.Report, err = env.Check(ctx); err != nil {
		return nil, err
	}
	if env.Bus == BusNATS {
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		acked, missed := redo.wait(rctx, env)
		cancel()
		res.Actions["redelivered"] = acked
		res.Report.NotRedelivered = len(missed)
		for _, h := range missed {
			res.Report.violate("%s: held by a killed node, never acknowledged since", h)
		}
		if res.Report.Stuck > 0 {
			res.Report.violate("NATS consumers now:\n%s", env.Groups(ctx))
		}
	}
	res.Duration = time.Since(began)
	return res, nil
}

// slot is one node of the soak, started again under the same name after a
// kill.
type slot struct {
	name  string
	roles []string
	node  *Node
}

// holdTransaction keeps a repeatable-read transaction open for d, holding
// back the cleanup of every row changed meanwhile, as a forgotten report
// query or a stuck migration does.
func holdTransaction(ctx context.Context, env *Env, d time.Duration) {
	tx, err := env.Pool.Begin(ctx)
	if err != nil {
		return // the server is restarting: nothing to hold
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"); err != nil {
		return
	}
	var n int
	if err := tx.QueryRow(ctx, "SELECT count(*) FROM "+OrdersSchema+".saga_instances").Scan(&n); err != nil {
		return
	}
	time.Sleep(d)
}
