package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/internal/safetext"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/wire"
)

// signalFlags are the flags of `sagaflow signal`.
type signalFlags struct {
	saga, key, id, payload, payloadFile string
	payloadFlag                         string // the flag the payload came from, for errors
}

// maxPayloadFileBytes bounds what --payload-file reads; the engine refuses a
// payload over its MaxStateBytes (1 MiB by default) with its own error.
const maxPayloadFileBytes = 64 << 20

func setupSignal(fs *flag.FlagSet) runFunc {
	f := &signalFlags{payloadFlag: "--payload"}
	fs.StringVar(&f.saga, "saga", "", "with --key: address the saga by its definition's `name` instead of its id")
	fs.StringVar(&f.key, "key", "", "with --saga: the business `key` the saga was started with")
	fs.StringVar(&f.payload, "payload", "", "the signal's content, a `JSON` document (default null)")
	fs.StringVar(&f.payloadFile, "payload-file", "", "read the signal's JSON document from `path` (- for stdin) instead of --payload:\n"+
		"for one longer than a command line holds (128 KiB per argument on Linux)")
	fs.StringVar(&f.id, "id", "", "signal `id`: a second signal with the same id to the same saga has no effect (default a new UUID)")
	return func(ctx context.Context, c *cli, args []string) error {
		if flagSet(fs, "payload-file") {
			if flagSet(fs, "payload") {
				return usageErrorf("signal: give --payload or --payload-file, not both")
			}
			p, err := readPayloadFile(f.payloadFile)
			if err != nil {
				return err
			}
			f.payload, f.payloadFlag = p, "--payload-file"
		}
		given := func(name string) bool { return flagSet(fs, name) || (name == "payload" && flagSet(fs, "payload-file")) }
		sig, err := f.signal(args, given)
		if err != nil {
			return err
		}
		engine, err := c.connect(ctx)
		if err != nil {
			return err
		}
		res, err := engine.Signal(ctx, sig)
		switch {
		case errors.Is(err, saga.ErrSignalRejected):
			return c.rejected(ctx, sig, res, err)
		case err != nil:
			return c.opError(err, "signal %s to %s", quote(sig.Name), signalTarget(sig, res))
		}
		return c.signalSent(sig, res)
	}
}

// signal checks the arguments and flags and builds the signal. Every
// field is checked here, with the name the operator gave it, before the
// database is reached: bad input writes nothing.
func (f *signalFlags) signal(args []string, given func(flag string) bool) (saga.Signal, error) {
	byKey := f.saga != "" || f.key != ""
	var sig saga.Signal
	switch {
	case byKey && (f.saga == "" || f.key == ""):
		return sig, usageErrorf("signal: --saga and --key go together: give both, or the saga's id instead")
	case byKey && len(args) > 1:
		return sig, usageErrorf("signal: give the saga's id or --saga and --key, not both (unexpected argument %q)", args[0])
	case byKey && len(args) == 0, !byKey && len(args) < 2:
		return sig, usageErrorf("signal: missing %s (run 'sagaflow help signal')", missingSignalArg(byKey, args))
	case !byKey && len(args) > 2:
		return sig, usageErrorf("signal: unexpected argument %q after the signal name", args[2])
	}
	if byKey {
		sig.Saga, sig.BusinessKey, sig.Name = f.saga, f.key, args[0]
	} else {
		id, err := uuid.Parse(args[0])
		if err != nil {
			return sig, usageErrorf("signal: saga id %q is not a UUID: %v", args[0], err)
		}
		sig.SagaID, sig.Name = id, args[1]
	}
	sig.ID = f.id
	if !given("id") {
		sig.ID = uuid.Must(uuid.NewV7()).String()
	}
	for _, in := range []struct {
		field, value string
		limit        int
	}{
		{"signal name", sig.Name, saga.MaxSignalNameBytes},
		{"--id", sig.ID, safetext.MaxKeyBytes},
		{"--saga", sig.Saga, wire.MaxNameBytes},
		{"--key", sig.BusinessKey, safetext.MaxKeyBytes},
		{f.payloadFlag, f.payload, 0},
	} {
		if p := safetext.Problem(in.value, in.limit); p != "" {
			return sig, usageErrorf("signal: %s %s", in.field, p)
		}
	}
	switch {
	case sig.Name == "":
		return sig, usageErrorf("signal: signal name is empty")
	case sig.ID == "":
		return sig, usageErrorf("signal: --id is empty")
	}
	if given("payload") {
		if err := checkJSON(f.payload); err != nil {
			return sig, usageErrorf("signal: %s is not a JSON document: %v", f.payloadFlag, err)
		}
		sig.Payload = json.RawMessage(f.payload)
	}
	return sig, nil
}

// readPayloadFile reads --payload-file: a file, or stdin for "-".
func readPayloadFile(path string) (string, error) {
	var r io.Reader = os.Stdin
	if path != "-" {
		f, err := os.Open(path)
		if err != nil {
			return "", usageErrorf("signal: --payload-file: %v", err)
		}
		defer f.Close()
		r = f
	}
	b, err := io.ReadAll(io.LimitReader(r, maxPayloadFileBytes+1))
	switch {
	case err != nil:
		return "", usageErrorf("signal: --payload-file: %v", err)
	case len(b) > maxPayloadFileBytes:
		return "", usageErrorf("signal: --payload-file holds more than %d bytes", maxPayloadFileBytes)
	}
	return string(b), nil
}

// missingSignalArg names what the positional arguments lack.
func missingSignalArg(byKey bool, args []string) string {
	switch {
	case byKey, len(args) == 1:
		return "signal name"
	}
	return "saga id and signal name"
}

// checkJSON returns why s is not one JSON document, or nil.
func checkJSON(s string) error {
	var v any
	return json.Unmarshal([]byte(s), &v)
}

// signalDoc is the --json output of `sagaflow signal`.
type signalDoc struct {
	SagaID    *uuid.UUID `json:"saga_id,omitempty"`
	Signal    string     `json:"signal"`
	ID        string     `json:"id"`
	Seq       int64      `json:"seq"`
	Duplicate bool       `json:"duplicate"`
	Result    string     `json:"result"` // "recorded", "duplicate" or "rejected"
	Message   string     `json:"message"`
	// Error and Code are set for a rejected signal, as in every error
	// document.
	Error string `json:"error,omitempty"`
	Code  int    `json:"code,omitempty"`
}

func newSignalDoc(sig saga.Signal, res saga.SignalResult, result, msg string) signalDoc {
	d := signalDoc{Signal: sig.Name, ID: sig.ID, Seq: res.Seq, Duplicate: res.Duplicate, Result: result, Message: msg}
	if res.SagaID != uuid.Nil {
		d.SagaID = &res.SagaID
	}
	return d
}

// signalSent prints what became of a signal the saga took.
func (c *cli) signalSent(sig saga.Signal, res saga.SignalResult) error {
	result := "recorded"
	msg := fmt.Sprintf("signal %s sent to saga %s (seq %d, id %s): an engine that knows the saga delivers it to a step that awaits it",
		quote(sig.Name), res.SagaID, res.Seq, quote(sig.ID))
	if res.Duplicate {
		result = "duplicate"
		msg = fmt.Sprintf("signal %s to saga %s: a signal with id %s was recorded before (seq %d): nothing new was written",
			quote(sig.Name), res.SagaID, quote(sig.ID), res.Seq)
	}
	if c.g.json {
		return writeJSON(c.stdout, newSignalDoc(sig, res, result, msg))
	}
	fmt.Fprintln(c.stdout, msg)
	return nil
}

// rejected reports a signal that no saga could take. It was recorded as
// rejected all the same; the exit code is 3 when no saga matched, else 1.
func (c *cli) rejected(ctx context.Context, sig saga.Signal, res saga.SignalResult, err error) error {
	is := func(sentinel error) bool { return errors.Is(err, sentinel) }
	code := exitFailed
	var why string
	switch {
	case is(saga.ErrNotFound):
		code = exitNotFound
		why = fmt.Sprintf("no such saga in schema %q", c.g.schema)
	case is(saga.ErrNotRunning):
		why = "the saga is not running"
		if in, gerr := c.engine.Get(ctx, res.SagaID); gerr == nil {
			why += " (its status is " + string(in.Status) + ")"
		}
	default:
		why = err.Error()
	}
	what := "recorded as rejected"
	if res.Duplicate {
		what = "a signal with id " + quote(sig.ID) + " was recorded as rejected before"
	}
	msg := fmt.Sprintf("signal %s to %s: %s (seq %d): %s", quote(sig.Name), signalTarget(sig, res), what, res.Seq, why)
	if c.g.json {
		d := newSignalDoc(sig, res, "rejected", msg)
		d.Error, d.Code = c.secrets.redact(msg), code
		if werr := writeJSON(c.stdout, d); werr != nil {
			return werr
		}
		return &silentError{code: code}
	}
	return &cliError{code: code, msg: msg}
}

// signalTarget names the saga a signal is addressed to.
func signalTarget(sig saga.Signal, res saga.SignalResult) string {
	switch {
	case sig.SagaID != uuid.Nil:
		return "saga " + sig.SagaID.String()
	case res.SagaID != uuid.Nil:
		return fmt.Sprintf("saga %s (%s key %s)", res.SagaID, quote(sig.Saga), quote(sig.BusinessKey))
	}
	return fmt.Sprintf("saga %s with key %s", quote(sig.Saga), quote(sig.BusinessKey))
}

// quote quotes an operator's or a stored string for a message; the message
// is escaped when it is printed.
func quote(s string) string { return fmt.Sprintf("%q", s) }
