package main

import (
	"context"
	"flag"
	"fmt"
)

// pauseResult is the JSON of pause and unpause.
type pauseResult struct {
	Target  string `json:"target"` // a saga id, or "type:" + name
	Result  string `json:"result"` // paused, already_paused, unpaused
	Message string `json:"message"`
}

func setupPause(fs *flag.FlagSet) runFunc {
	reason := fs.String("reason", "paused with the sagaflow CLI", "`text` recorded with the pause")
	typ := fs.String("type", "", "pause every saga of this `name`, and those started while it is paused")
	return func(ctx context.Context, c *cli, args []string) error {
		engine, err := c.connect(ctx)
		if err != nil {
			return err
		}
		var r pauseResult
		if *typ != "" {
			if len(args) > 0 {
				return usageErrorf("pause: give a saga id or --type, not both")
			}
			fresh, err := engine.PauseType(ctx, *typ, *reason)
			if err != nil {
				return c.opError(err, "pause type %q", *typ)
			}
			r = pauseResult{Target: "type:" + *typ, Result: "paused",
				Message: fmt.Sprintf("every saga named %q is paused: no new step starts until `sagaflow unpause --type %s`", *typ, *typ)}
			if !fresh {
				r.Result, r.Message = "already_paused", fmt.Sprintf("sagas named %q were paused already", *typ)
			}
		} else {
			id, err := parseID("pause", args)
			if err != nil {
				return err
			}
			if err := engine.Pause(ctx, id, *reason); err != nil {
				return c.opError(err, "pause %s", id)
			}
			r = pauseResult{Target: id.String(), Result: "paused",
				Message: fmt.Sprintf("saga %s is paused: a step that runs finishes, no new step starts until `sagaflow unpause %s`", id, id)}
		}
		if c.g.json {
			return writeJSON(c.stdout, r)
		}
		fmt.Fprintln(c.stdout, r.Message)
		return nil
	}
}

func setupUnpause(fs *flag.FlagSet) runFunc {
	reason := fs.String("reason", "unpaused with the sagaflow CLI", "`text` recorded in the saga's timeline")
	typ := fs.String("type", "", "lift the pause of every saga of this `name`")
	return func(ctx context.Context, c *cli, args []string) error {
		engine, err := c.connect(ctx)
		if err != nil {
			return err
		}
		var r pauseResult
		if *typ != "" {
			if len(args) > 0 {
				return usageErrorf("unpause: give a saga id or --type, not both")
			}
			lifted, err := engine.ResumeType(ctx, *typ)
			if err != nil {
				return c.opError(err, "unpause type %q", *typ)
			}
			if !lifted {
				// As for a saga that is not paused (review27 O7).
				return &cliError{code: exitFailed, msg: fmt.Sprintf("unpause type %q: sagas named %q are not paused as a type", *typ, *typ)}
			}
			r = pauseResult{Target: "type:" + *typ, Result: "unpaused",
				Message: fmt.Sprintf("sagas named %q continue (those paused on their own stay paused)", *typ)}
		} else {
			id, err := parseID("unpause", args)
			if err != nil {
				return err
			}
			// Not Resume, which would replay a failed saga (one whose
			// pause another operator lifted a moment ago).
			if err := engine.Unpause(ctx, id, *reason); err != nil {
				return c.opError(err, "unpause %s", id)
			}
			r = pauseResult{Target: id.String(), Result: "unpaused",
				Message: fmt.Sprintf("saga %s continues where it paused; an engine that knows it runs it", id)}
		}
		if c.g.json {
			return writeJSON(c.stdout, r)
		}
		fmt.Fprintln(c.stdout, r.Message)
		return nil
	}
}
