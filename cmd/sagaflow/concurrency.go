package main

import (
	"fmt"

	"github.com/sagaflow/sagaflow/saga"
)

// formatConcurrency prints a saga's place under its concurrency key:
// "KEY: waiting, 3rd of the queue (2/2 running)" or "KEY: holds a slot
// (1/2 running)"; "-" without a key.
func formatConcurrency(c *saga.ConcurrencyInfo) string {
	if c == nil {
		return "-"
	}
	key := oneLine(c.Key, errorWidth)
	if c.Queued {
		return fmt.Sprintf("%s: waiting, position %d (%d/%d running)", key, c.Position, c.Running, c.Limit)
	}
	return fmt.Sprintf("%s (%d/%d running)", key, c.Running, c.Limit)
}

// listWait is the WAIT cell of a listed saga: what it waits for, or its
// place in its concurrency key's queue.
func listWait(in *saga.Instance) string {
	if in.Concurrency != nil && in.Concurrency.Queued {
		return fmt.Sprintf("queued:%s #%d", oneLine(in.Concurrency.Key, errorWidth), in.Concurrency.Position)
	}
	return formatWait(in.Wait)
}
