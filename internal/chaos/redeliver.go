package chaos

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"time"
)

// redeliveryKill kills one of slots' nodes while it holds messages it
// fetched and has not acknowledged (over NATS), and records those its
// consumer had not acknowledged, which JetStream must redeliver. Every
// other time it then waits for a node to take one of them again and kills
// that one too while it holds it. A killed node starts again.
func redeliveryKill(ctx context.Context, env *Env, cfg SoakConfig, rng *rand.Rand, slots []*slot, res *SoakResult, redo *redeliveries) error {
	ms := func(lo, hi int) time.Duration { return time.Duration(lo+rng.IntN(hi-lo+1)) * time.Millisecond }
	s, held, err := holding(env, rng, slots, 10*time.Second, nil)
	if err != nil || s == nil {
		if s == nil && err == nil {
			cfg.Logf("chaos: no %s node held a message within 10 s", slots[0].name)
			res.Actions["redelivery_kill_missed"]++
		}
		return err
	}
	s.node.Kill()
	res.Actions["redelivery_kill"]++
	pending := redo.add(ctx, env, held)
	cfg.Logf("chaos: SIGKILL %s holding %v; unacknowledged, to be redelivered: %v", s.name, held, pending)
	time.Sleep(ms(200, 2000))
	if s.node, err = env.StartNode(s.name, s.roles, ""); err != nil {
		return err
	}
	if len(pending) == 0 || rng.IntN(2) == 0 {
		return nil
	}
	// Kill the node that takes a redelivered message, while it holds it.
	again, held, err := holding(env, rng, slots, NATSAckWait+5*time.Second, pending)
	if err != nil || again == nil {
		return err
	}
	again.node.Kill()
	res.Actions["redelivery_kill_again"]++
	cfg.Logf("chaos: SIGKILL %s holding redelivered %v", again.name, held)
	redo.add(ctx, env, held)
	time.Sleep(ms(200, 1000))
	again.node, err = env.StartNode(again.name, again.roles, "")
	return err
}

// holding waits up to d for one of slots' nodes to report holding a
// message (one of among, when set), stops it (SIGSTOP) and reads its list
// again: so that it cannot acknowledge what it holds before it is killed.
// It returns the stopped node and what it holds, or nil when none held
// anything in time.
func holding(env *Env, rng *rand.Rand, slots []*slot, d time.Duration, among []Held) (*slot, []Held, error) {
	match := func(hs []Held) []Held {
		if among == nil {
			return hs
		}
		var out []Held
		for _, h := range hs {
			if slices.Contains(among, h) {
				out = append(out, h)
			}
		}
		return out
	}
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		for _, i := range rng.Perm(len(slots)) {
			s := slots[i]
			path := heldFile(env.Dir, s.name)
			if len(match(ReadHeld(path))) == 0 || !s.node.Alive() {
				continue
			}
			if err := s.node.Pause(); err != nil {
				return nil, nil, err
			}
			if hs := match(ReadHeld(path)); len(hs) > 0 {
				return s, hs, nil
			}
			if err := s.node.Resume(); err != nil {
				return nil, nil, err
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	return nil, nil, nil
}

// redeliveries are the messages killed nodes held unacknowledged, which
// their consumers must acknowledge later (after a redelivery to another
// node).
type redeliveries struct {
	mu      sync.Mutex
	pending []Held
}

// add records those of held that their consumer has not acknowledged (the
// node is dead: only a redelivery can), and returns them.
func (r *redeliveries) add(ctx context.Context, env *Env, held []Held) []Held {
	var out []Held
	for _, h := range held {
		for try := 0; ; try++ {
			cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			acked, err := env.ackedPast(cctx, h)
			cancel()
			if err == nil {
				if !acked {
					out = append(out, h)
				}
				break
			}
			if try == 20 {
				out = append(out, h) // unknown: it must be acknowledged later anyway
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, h := range out {
		if !slices.Contains(r.pending, h) {
			r.pending = append(r.pending, h)
		}
	}
	return out
}

// wait waits until every recorded message is acknowledged, or ctx ends; it
// returns how many were and those that were not.
func (r *redeliveries) wait(ctx context.Context, env *Env) (acked int, missed []Held) {
	r.mu.Lock()
	left := slices.Clone(r.pending)
	r.mu.Unlock()
	total := len(left)
	for len(left) > 0 {
		var still []Held
		for _, h := range left {
			if ok, err := env.ackedPast(ctx, h); err != nil || !ok {
				still = append(still, h)
			}
		}
		left = still
		if len(left) == 0 {
			break
		}
		select {
		case <-ctx.Done():
			return total - len(left), left
		case <-time.After(200 * time.Millisecond):
		}
	}
	return total, nil
}
