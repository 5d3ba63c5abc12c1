package ui

import (
	"crypto/rand"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/saga"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// The actions [Config.Authorize] is asked about.
const (
	ActionResume  = "resume"  // resume a failed saga (saga.Engine.Resume)
	ActionRerun   = "rerun"   // re-run an ended saga from a step (saga.Engine.Rerun)
	ActionCancel  = "cancel"  // cancel a running saga (saga.Engine.Cancel)
	ActionPause   = "pause"   // pause a saga that has not ended (saga.Engine.Pause)
	ActionUnpause = "unpause" // lift a saga's own pause (saga.Engine.Unpause)
	ActionReplay  = "replay"  // bulk replay (saga.Engine.ReplayBulk)
	ActionRequeue = "requeue" // requeue dead messages and letters (saga.Engine.RequeueDead)
)

// ErrReadOnly is what a write is refused with when the handler has no
// [Config.Authorize].
var ErrReadOnly = errors.New("ui: read-only: no Authorize hook is configured")

// PageSizeDefault is the number of sagas, dead messages or dead letters on
// a page when the request does not say.
const PageSizeDefault = 50

// PreviewBytesDefault is how many bytes of a payload the dead page shows.
const PreviewBytesDefault = 256

// Config configures the handler. The zero value serves a read-only UI of
// the engine's schema, with state and payloads hidden.
type Config struct {
	// Schema holds sagaflow's tables; it must be the engine's ([New]
	// refuses another). Defaults to the engine's.
	Schema string
	// Prefix is the path the handler is mounted at ("/ops/sagas"), without
	// a trailing slash; links and forms start with it. Mount the handler
	// at Prefix+"/" either as it is or inside http.StripPrefix(Prefix, …):
	// both work. Defaults to "" (the root).
	Prefix string
	// Authorize, when set, allows writes: it is called with each request
	// that would show an action's form or perform it, and the action (one
	// of the Action constants); a nil error allows it. Without it the
	// handler is read-only.
	Authorize func(r *http.Request, action string) error
	// Actor names who makes a request, for the saga's history ("by alice").
	// Defaults to "anonymous".
	Actor func(r *http.Request) string
	// Redact returns what of a saga's state (JSON) may be shown, or nil to
	// hide it. Without it state is hidden. Return the state unchanged to
	// show it all.
	Redact func(sagaName string, state []byte) []byte
	// RedactPayload returns what of a dead message's payload (its first
	// PreviewBytes bytes) or a dead letter's value may be shown, or nil to
	// hide it; topic is the message's topic. Without it payloads are hidden
	// (their sizes are shown).
	RedactPayload func(topic string, payload []byte) []byte
	// PreviewBytes is how many bytes of a payload are read for the dead
	// page. Defaults to PreviewBytesDefault.
	PreviewBytes int
	// Logger receives the errors behind 500 responses. Defaults to
	// slog.Default().
	Logger *slog.Logger
	// Hosts, when set, are the only Host header values the handler answers
	// (host or host:port, compared without regard to case); any other gets
	// 421 Misdirected Request. Set it when the UI listens where a browser
	// can reach it by an address of its own (a loopback port): a web page
	// whose name an attacker points at that address (DNS rebinding) then
	// gets nothing, since the browser sends the attacker's name as Host.
	// `sagaflow ui` sets it to the address it listens on.
	Hosts []string
}

// Handler serves the UI. Make one with [New].
type Handler struct {
	pool   *pgxpool.Pool
	engine *saga.Engine
	st     *store.Store
	cfg    Config
	pages  map[string]*template.Template
	mux    *http.ServeMux
	static http.Handler
}

// New returns the UI of the sagas engine reads and steers, querying pool
// for what the engine's API does not offer. The engine may be a client
// that is never started; when it has registered definitions, the saga page
// draws them and previews use them, else both use the steps a saga's
// timeline shows. A nil cfg means the defaults.
func New(pool *pgxpool.Pool, engine *saga.Engine, cfg *Config) (*Handler, error) {
	if pool == nil {
		return nil, errors.New("ui: nil pool")
	}
	if engine == nil {
		return nil, errors.New("ui: nil engine")
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.Schema == "" {
		c.Schema = engine.Schema()
	}
	if c.Schema != engine.Schema() {
		// The pages read some tables of Schema directly and act through the
		// engine: two schemas would mix two tenants (review26 O5).
		return nil, fmt.Errorf("ui: Schema %q is not the engine's (%q)", c.Schema, engine.Schema())
	}
	if c.Prefix != "" && (!strings.HasPrefix(c.Prefix, "/") || strings.HasSuffix(c.Prefix, "/")) {
		return nil, fmt.Errorf("ui: Prefix %q must start with '/' and not end with one", c.Prefix)
	}
	if i := strings.IndexFunc(c.Prefix, func(r rune) bool { return !prefixRune(r) }); i >= 0 || strings.Contains(c.Prefix, "//") {
		// A cookie's path and the links must say the prefix as the
		// browser sends it; other bytes would be escaped in one and not
		// the other (review26 F6).
		return nil, fmt.Errorf("ui: Prefix %q may hold only letters, digits, '-', '.', '_', '~' and single '/' (ASCII)", c.Prefix)
	}
	for _, host := range c.Hosts {
		if host == "" || strings.ContainsAny(host, "/ \t") {
			return nil, fmt.Errorf("ui: Hosts: %q is not a host (or host:port)", host)
		}
	}
	if c.PreviewBytes < 0 {
		return nil, fmt.Errorf("ui: PreviewBytes %d is negative", c.PreviewBytes)
	}
	if c.PreviewBytes == 0 {
		c.PreviewBytes = PreviewBytesDefault
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	st, err := store.New(c.Schema)
	if err != nil {
		return nil, fmt.Errorf("ui: Schema: %w", err)
	}
	h := &Handler{pool: pool, engine: engine, st: st, cfg: c, pages: map[string]*template.Template{}}
	for _, page := range []string{"overview", "list", "saga", "dead", "preview", "bulk", "requeue", "error"} {
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/"+page+".html")
		if err != nil {
			return nil, fmt.Errorf("ui: parse template %s: %w", page, err)
		}
		h.pages[page] = t
	}
	sub, err := fs.Sub(staticFS, "static")
	if err != nil {
		return nil, fmt.Errorf("ui: static files: %w", err)
	}
	h.static = http.StripPrefix("/static/", http.FileServerFS(sub))
	h.routes()
	return h, nil
}

func (h *Handler) routes() {
	m := http.NewServeMux()
	m.HandleFunc("GET /{$}", h.overview)
	m.HandleFunc("GET /sagas", h.list)
	m.HandleFunc("GET /sagas/{id}", h.sagaPage)
	m.HandleFunc("GET /sagas/{id}/{action}", h.previewAction)
	m.HandleFunc("POST /sagas/{id}/{action}", h.doAction)
	m.HandleFunc("GET /dead", h.dead)
	m.HandleFunc("GET /replay", h.previewBulk)
	m.HandleFunc("POST /replay", h.doBulk)
	m.HandleFunc("GET /requeue", h.previewRequeue)
	m.HandleFunc("POST /requeue", h.doRequeue)
	m.Handle("GET /static/", h.static)
	h.mux = m
}

// ServeHTTP serves the UI.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	hdr := w.Header()
	hdr.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "+
		"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	hdr.Set("X-Content-Type-Options", "nosniff")
	hdr.Set("Referrer-Policy", "same-origin")
	hdr.Set("X-Frame-Options", "DENY")
	if len(h.cfg.Hosts) > 0 && !slices.ContainsFunc(h.cfg.Hosts, func(host string) bool { return strings.EqualFold(host, r.Host) }) {
		http.Error(w, "ui: this server does not answer for host "+strconv.Quote(visible(r.Host)), http.StatusMisdirectedRequest)
		return
	}
	// Mounted as it is, or inside http.StripPrefix: the prefix is there
	// or it is not.
	path := r.URL.Path
	if h.cfg.Prefix != "" {
		if rest, ok := strings.CutPrefix(path, h.cfg.Prefix); ok && (rest == "" || rest[0] == '/') {
			path = rest
		}
	}
	if path == "" {
		http.Redirect(w, r, h.cfg.Prefix+"/", http.StatusMovedPermanently)
		return
	}
	r2 := r.Clone(r.Context())
	r2.URL.Path, r2.URL.RawPath = path, ""
	h.mux.ServeHTTP(w, r2)
}

// csrfCookie is the name of the cookie holding the browser's CSRF token.
const csrfCookie = "sagaflow_csrf"

// csrfToken returns the browser's CSRF token, setting a new one when it
// has none.
func (h *Handler) csrfToken(w http.ResponseWriter, r *http.Request) string {
	if c, err := r.Cookie(csrfCookie); err == nil && validToken(c.Value) {
		return c.Value
	}
	var b [32]byte
	_, _ = rand.Read(b[:])
	tok := hex.EncodeToString(b[:])
	path := h.cfg.Prefix + "/"
	http.SetCookie(w, &http.Cookie{Name: csrfCookie, Value: tok, Path: path, HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil})
	return tok
}

// prefixRune reports whether r may appear in Config.Prefix: URL path
// bytes that need no escaping.
func prefixRune(r rune) bool {
	return r < 0x80 && (r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-._~/", r))
}

func validToken(s string) bool {
	if len(s) != 64 {
		return false
	}
	_, err := hex.DecodeString(s)
	return err == nil
}

// checkWrite refuses a write that is not allowed for action, or that
// might come from another site. It returns the status and the message.
func (h *Handler) checkWrite(r *http.Request, action string) (int, error) {
	if err := h.authorize(r, action); err != nil {
		return http.StatusForbidden, err
	}
	site, origin := r.Header.Get("Sec-Fetch-Site"), r.Header.Get("Origin")
	if site == "" && origin == "" {
		// Browsers send at least one of them with a form's POST: a request
		// with neither did not come from this UI's page (review26 F4).
		return http.StatusForbidden, errors.New("a write must say where it comes from (Origin or Sec-Fetch-Site): send it from the UI's page")
	}
	if site != "" && site != "same-origin" {
		return http.StatusForbidden, fmt.Errorf("cross-site request refused (Sec-Fetch-Site: %s)", visible(site))
	}
	if origin != "" {
		u, err := url.Parse(origin)
		if err != nil || u.Host != r.Host {
			return http.StatusForbidden, errors.New("cross-origin request refused (Origin does not match Host)")
		}
	}
	c, err := r.Cookie(csrfCookie)
	form := r.PostFormValue("csrf")
	if err != nil || !validToken(c.Value) || subtle.ConstantTimeCompare([]byte(c.Value), []byte(form)) != 1 {
		return http.StatusForbidden, errors.New("missing or wrong CSRF token: reload the page and try again")
	}
	return 0, nil
}

// authorize asks Config.Authorize about action.
func (h *Handler) authorize(r *http.Request, action string) error {
	if h.cfg.Authorize == nil {
		return ErrReadOnly
	}
	if err := h.cfg.Authorize(r, action); err != nil {
		return fmt.Errorf("ui: %s not allowed: %w", action, err)
	}
	return nil
}

// allowed reports whether the request may see the form of action.
func (h *Handler) allowed(r *http.Request, action string) bool { return h.authorize(r, action) == nil }

func (h *Handler) actor(r *http.Request) string {
	a := ""
	if h.cfg.Actor != nil {
		a = h.cfg.Actor(r)
	}
	if a == "" {
		a = "anonymous"
	}
	return a
}

// reason is what an action records in the saga's history.
func (h *Handler) reason(r *http.Request, action string) string {
	why := strings.TrimSpace(r.PostFormValue("reason"))
	s := action + " by " + h.actor(r) + " in the web UI"
	if why != "" {
		s += ": " + why
	}
	return s
}

// render writes page with data. Data is completed with the common fields.
func (h *Handler) render(w http.ResponseWriter, r *http.Request, status int, page string, data map[string]any) {
	data["Prefix"] = h.cfg.Prefix
	data["CSRF"] = h.csrfToken(w, r)
	data["Page"] = page
	data["ReadOnly"] = h.cfg.Authorize == nil
	var b strings.Builder
	if err := h.pages[page].Execute(&b, data); err != nil {
		h.cfg.Logger.Error("ui: render", "page", page, "err", err)
		http.Error(w, "ui: render failed", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write([]byte(b.String()))
}

// fail renders an error page; 500s are logged, and their detail is not
// shown.
func (h *Handler) fail(w http.ResponseWriter, r *http.Request, status int, err error) {
	msg := err.Error()
	if status >= 500 {
		h.cfg.Logger.Error("ui: request failed", "path", r.URL.Path, "err", err)
		msg = "internal error; the server's log has the detail"
	}
	h.render(w, r, status, "error", map[string]any{"Title": http.StatusText(status), "Status": status, "Message": msg})
}
