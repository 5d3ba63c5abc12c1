package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/sagaflow/sagaflow/ui"
)

// uiListenDefault serves the UI on this machine only.
const uiListenDefault = "127.0.0.1:8080"

var uiCommand = command{name: "ui", args: "[--listen ADDR] [--allow-writes] [flags]", setup: setupUI,
	summary: "serve the web UI for operators",
	about: "Serve the web UI on --listen until interrupted: an overview, the sagas with filters, each saga's\n" +
		"definition, timeline and state, dead messages and letters. It is read-only unless --allow-writes,\n" +
		"which lets everyone who can reach it resume, re-run, cancel, replay in bulk and requeue, each after\n" +
		"a preview; actions are recorded as done by --actor. It authenticates no one: keep it on a loopback\n" +
		"address, or behind a proxy that authenticates. State and payloads are hidden unless --show-state\n" +
		"and --show-payloads. --timeout bounds connecting to the database, not serving."}

func setupUI(fs *flag.FlagSet) runFunc {
	listen := fs.String("listen", uiListenDefault, "`address` to listen on (default "+uiListenDefault+")")
	allowWrites := fs.Bool("allow-writes", false, "allow actions (resume, rerun, cancel, bulk replay, requeue), after a preview")
	actor := fs.String("actor", "", "`name` recorded in the history of actions (default $USER, else \"sagaflow ui\")")
	showState := fs.Bool("show-state", false, "show saga state (otherwise hidden)")
	showPayloads := fs.Bool("show-payloads", false, "show the first bytes of dead payloads, escaped and in hex (otherwise hidden)")
	prefix := fs.String("prefix", "", "serve under this `path` (\"/sagaflow\"), for a proxy that forwards it")
	hosts := fs.String("hosts", "", "comma-separated `names` (host or host:port) browsers may reach the UI by, besides the\n"+
		"own address of a loopback --listen; other Host headers get 421 (this keeps a web page whose name an\n"+
		"attacker points at this address from using the UI); with a non-loopback --listen and no --hosts, every\n"+
		"Host is answered")
	return func(ctx context.Context, c *cli, args []string) error {
		if err := noArgs("ui", args); err != nil {
			return err
		}
		// A malformed address is bad usage; one that cannot be bound
		// (taken, not this host's) is a failure, found when listening.
		if _, port, err := net.SplitHostPort(*listen); err != nil || port == "" || !validPort(port) {
			return usageErrorf("ui: --listen %q is not a host:port address (such as %s)", *listen, uiListenDefault)
		}
		engine, err := c.connect(ctx)
		if err != nil {
			return err
		}
		name := *actor
		if name == "" {
			name = c.getenv("USER")
		}
		if name == "" {
			name = "sagaflow ui"
		}
		cfg := &ui.Config{Schema: c.g.schema, Prefix: *prefix, Logger: slog.New(slog.NewTextHandler(c.stderr, nil)),
			Actor: func(*http.Request) string { return name }}
		if *allowWrites {
			cfg.Authorize = func(*http.Request, string) error { return nil }
		}
		if *showState {
			cfg.Redact = func(_ string, state []byte) []byte { return state }
		}
		if *showPayloads {
			cfg.RedactPayload = func(_ string, p []byte) []byte { return p }
		}
		ln, err := net.Listen("tcp", *listen)
		if err != nil {
			return &cliError{code: exitFailed, msg: fmt.Sprintf("ui: listen on %s: %s", *listen, err)}
		}
		cfg.Hosts = uiHosts(ln.Addr(), *hosts)
		if ta, ok := ln.Addr().(*net.TCPAddr); ok && *allowWrites && !ta.IP.IsLoopback() {
			fmt.Fprintf(c.stderr, "sagaflow ui: warning: actions are allowed to everyone who can reach %s; "+
				"keep it behind a proxy that authenticates\n", ln.Addr())
		}
		h, err := ui.New(c.pool, engine, cfg)
		if err != nil {
			_ = ln.Close()
			return usageErrorf("ui: %s", err)
		}
		mux := http.NewServeMux()
		mux.Handle(*prefix+"/", h)
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		fmt.Fprintf(c.stdout, "serving the sagaflow UI on http://%s%s/ (%s)\n", ln.Addr(), *prefix, map[bool]string{
			true: "actions allowed", false: "read-only"}[*allowWrites])
		// --timeout bounds the setup; serving ends with an interrupt (the
		// parent context's cancellation), not with the deadline.
		done := make(chan error, 1)
		go func() { done <- srv.Serve(ln) }()
		sig, stopSignals := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stopSignals()
		go func() {
			select {
			case <-sig.Done():
			case <-ctx.Done():
				if !errors.Is(ctx.Err(), context.Canceled) {
					<-sig.Done()
				}
			}
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = srv.Shutdown(sctx)
		}()
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			return &cliError{code: exitFailed, msg: fmt.Sprintf("ui: serve: %s", err)}
		}
		return nil
	}
}

// uiHosts is what the UI answers as Host when it listens on addr: for a
// loopback address, the address itself and localhost with its port; then
// the names given (comma-separated). Nil (any Host) for another address
// with no names given: a proxy in front names the host.
func uiHosts(addr net.Addr, names string) []string {
	var out []string
	if ta, ok := addr.(*net.TCPAddr); ok && ta.IP.IsLoopback() {
		port := strconv.Itoa(ta.Port)
		out = append(out, net.JoinHostPort(ta.IP.String(), port), "localhost:"+port)
	}
	for _, n := range strings.Split(names, ",") {
		if n = strings.TrimSpace(n); n != "" {
			out = append(out, n)
		}
	}
	return out
}

// validPort reports whether port is a TCP port number (0 to 65535) or a
// service name this host knows, as net.Listen takes.
func validPort(port string) bool {
	if n, err := strconv.Atoi(port); err == nil {
		return n >= 0 && n <= 65535
	}
	_, err := net.LookupPort("tcp", port)
	return err == nil
}
