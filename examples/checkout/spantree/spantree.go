// Package spantree records the spans of the checkout demo in memory and
// draws one trace as a tree, with each span's service and duration: a
// picture of where an order went and where its time was spent.
//
// It implements OpenTelemetry's tracing API itself, so that the demo needs
// no SDK (sagaflow's module links the API only). A real service uses the
// SDK and an exporter instead: see examples/otel.
package spantree

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"sort"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/embedded"
)

// Recorder keeps every span its providers start.
type Recorder struct {
	mu    sync.Mutex
	spans []*Span
}

// Provider returns a TracerProvider whose spans are recorded as the
// service's.
func (r *Recorder) Provider(service string) trace.TracerProvider {
	return &provider{r: r, service: service}
}

// Span is a recorded span.
type Span struct {
	embedded.Span
	p        *provider
	Service  string
	Name     string
	Context  trace.SpanContext
	Parent   trace.SpanID // zero for a root
	Links    []trace.Link
	Start    time.Time
	EndTime  time.Time
	Attrs    []attribute.KeyValue
	Failed   bool
	mu       sync.Mutex
	finished bool
}

type provider struct {
	embedded.TracerProvider
	r       *Recorder
	service string
}

func (p *provider) Tracer(string, ...trace.TracerOption) trace.Tracer { return &tracer{p: p} }

type tracer struct {
	embedded.Tracer
	p *provider
}

func (t *tracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	cfg := trace.NewSpanStartConfig(opts...)
	parent := trace.SpanContextFromContext(ctx)
	if cfg.NewRoot() {
		parent = trace.SpanContext{}
	}
	traceID := parent.TraceID()
	if !parent.IsValid() {
		_, _ = rand.Read(traceID[:])
	}
	var spanID trace.SpanID
	_, _ = rand.Read(spanID[:])
	s := &Span{p: t.p, Service: t.p.service, Name: name, Parent: parent.SpanID(), Links: cfg.Links(), Attrs: cfg.Attributes(),
		Context: trace.NewSpanContext(trace.SpanContextConfig{TraceID: traceID, SpanID: spanID, TraceFlags: trace.FlagsSampled}),
		Start:   cfg.Timestamp()}
	if s.Start.IsZero() {
		s.Start = time.Now()
	}
	t.p.r.mu.Lock()
	t.p.r.spans = append(t.p.r.spans, s)
	t.p.r.mu.Unlock()
	return trace.ContextWithSpan(ctx, s), s
}

// End implements trace.Span.
func (s *Span) End(opts ...trace.SpanEndOption) {
	cfg := trace.NewSpanEndConfig(opts...)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.finished {
		return
	}
	s.finished, s.EndTime = true, cfg.Timestamp()
	if s.EndTime.IsZero() {
		s.EndTime = time.Now()
	}
}

// AddEvent implements trace.Span; events are not drawn.
func (s *Span) AddEvent(string, ...trace.EventOption) {}

// AddLink implements trace.Span.
func (s *Span) AddLink(l trace.Link) {
	s.mu.Lock()
	s.Links = append(s.Links, l)
	s.mu.Unlock()
}

// IsRecording implements trace.Span.
func (s *Span) IsRecording() bool { return true }

// RecordError implements trace.Span.
func (s *Span) RecordError(error, ...trace.EventOption) {}

// SpanContext implements trace.Span.
func (s *Span) SpanContext() trace.SpanContext { return s.Context }

// SetStatus implements trace.Span.
func (s *Span) SetStatus(c codes.Code, _ string) {
	s.mu.Lock()
	s.Failed = c == codes.Error
	s.mu.Unlock()
}

// SetName implements trace.Span.
func (s *Span) SetName(name string) {
	s.mu.Lock()
	s.Name = name
	s.mu.Unlock()
}

// SetAttributes implements trace.Span.
func (s *Span) SetAttributes(kv ...attribute.KeyValue) {
	s.mu.Lock()
	s.Attrs = append(s.Attrs, kv...)
	s.mu.Unlock()
}

// TracerProvider implements trace.Span.
func (s *Span) TracerProvider() trace.TracerProvider { return s.p }

// Trace returns the ended spans of trace id, by start time.
func (r *Recorder) Trace(id trace.TraceID) []*Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*Span
	for _, s := range r.spans {
		s.mu.Lock()
		done := s.finished
		s.mu.Unlock()
		if done && s.Context.TraceID() == id {
			out = append(out, s)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Start.Before(out[j].Start) })
	return out
}

// Services lists the services that have spans in trace id.
func (r *Recorder) Services(id trace.TraceID) []string {
	seen := map[string]bool{}
	var out []string
	for _, s := range r.Trace(id) {
		if !seen[s.Service] {
			seen[s.Service] = true
			out = append(out, s.Service)
		}
	}
	sort.Strings(out)
	return out
}

// Draw writes trace id as a tree: one line per span, indented under its
// parent, with its service, its offset from the trace's start and its
// duration. A span whose parent is not in the trace (a remote parent that
// recorded nothing here) is drawn at the root.
func (r *Recorder) Draw(w io.Writer, id trace.TraceID) {
	spans := r.Trace(id)
	if len(spans) == 0 {
		fmt.Fprintf(w, "trace %s: no spans\n", id)
		return
	}
	byID := map[trace.SpanID]*Span{}
	for _, s := range spans {
		byID[s.Context.SpanID()] = s
	}
	children := map[trace.SpanID][]*Span{}
	var roots []*Span
	for _, s := range spans {
		if _, ok := byID[s.Parent]; ok && s.Parent.IsValid() {
			children[s.Parent] = append(children[s.Parent], s)
		} else {
			roots = append(roots, s)
		}
	}
	t0 := spans[0].Start
	fmt.Fprintf(w, "trace %s: %d spans across %s\n", id, len(spans), strings.Join(r.Services(id), ", "))
	var draw func(s *Span, prefix string, last bool)
	draw = func(s *Span, prefix string, last bool) {
		branch, next := "├─ ", "│  "
		if last {
			branch, next = "└─ ", "   "
		}
		mark := ""
		if s.Failed {
			mark = "  ✗"
		}
		head := prefix + branch + s.Name
		pad := max(nameWidth-utf8.RuneCountInString(head), 1)
		fmt.Fprintf(w, "%s%s %-10s +%7.1fms %8.1fms%s\n", head, strings.Repeat(" ", pad), s.Service,
			ms(s.Start.Sub(t0)), ms(s.EndTime.Sub(s.Start)), mark)
		kids := children[s.Context.SpanID()]
		for i, c := range kids {
			draw(c, prefix+next, i == len(kids)-1)
		}
	}
	for i, s := range roots {
		draw(s, "", i == len(roots)-1)
	}
}

// nameWidth is the width of the tree and the span names' column.
const nameWidth = 64

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
