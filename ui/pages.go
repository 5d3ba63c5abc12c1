package ui

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/saga"
	"github.com/sagaflow/sagaflow/steps"
)

// Bounds of the overview's queries: each reads at most this many rows, so
// that the page stays quick on tables of any size (about 20 ms each on a
// million sagas and five million history entries, on two busy cores).
const (
	overviewSagaScan    = 20_000 // the newest sagas counted by type and status
	overviewFailureScan = 10_000 // the newest sagas of a status whose last errors are grouped
	overviewHistoryScan = 50_000 // the newest history entries counted per minute
	overviewTopFailures = 10
)

var statusNames = []string{string(saga.StatusRunning), string(saga.StatusCompensating), string(saga.StatusCompleted),
	string(saga.StatusCompensated), string(saga.StatusFailed)}

// countRow is one saga type's counts on the overview, by status.
type countRow struct {
	Name   string
	Counts []int64 // in the order of statusNames
}

// bar is one minute of the overview's chart.
type bar struct {
	X, Height, Y    int
	FailHeight      int // the failed part, drawn on top
	Label           string
	Completed, Fail int64
}

func (h *Handler) overview(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	// The queries are independent: they run at once, each on its own
	// connection.
	var (
		counts              []store.SagaCount
		scanned             int64
		failed, compensated []store.FailureCount
		ob                  outbox.Status
		minutes             []store.MinuteCount
		now, since          time.Time
		wg                  sync.WaitGroup
		errs                [5]error
	)
	wg.Go(func() { counts, scanned, errs[0] = h.st.SagaCounts(ctx, h.pool, overviewSagaScan) })
	wg.Go(func() {
		failed, errs[1] = h.st.TopFailures(ctx, h.pool, string(saga.StatusFailed), overviewFailureScan, overviewTopFailures)
	})
	wg.Go(func() {
		compensated, errs[2] = h.st.TopFailures(ctx, h.pool, string(saga.StatusCompensated), overviewFailureScan, overviewTopFailures)
	})
	wg.Go(func() { ob, errs[3] = h.engine.OutboxStatus(ctx) })
	wg.Go(func() { minutes, now, since, errs[4] = h.st.StepsPerMinute(ctx, h.pool, overviewHistoryScan) })
	wg.Wait()
	if err := errors.Join(errs[:]...); err != nil {
		h.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	var rows []countRow
	for _, c := range counts {
		if len(rows) == 0 || rows[len(rows)-1].Name != c.Name {
			rows = append(rows, countRow{Name: c.Name, Counts: make([]int64, len(statusNames))})
		}
		if i := slices.Index(statusNames, c.Status); i >= 0 {
			rows[len(rows)-1].Counts[i] = c.Count
		}
	}
	// Sixty bars, the current minute last.
	const barW, chartH = 10, 100
	byMinute := map[int64][2]int64{}
	var peak, total, fails int64
	for _, m := range minutes {
		byMinute[m.Minute.Unix()] = [2]int64{m.Completed, m.Failed}
		peak = max(peak, m.Completed+m.Failed)
		total += m.Completed
		fails += m.Failed
	}
	last := now.Truncate(time.Minute)
	var bars []bar
	for i := range 60 {
		t := last.Add(time.Duration(i-59) * time.Minute)
		c := byMinute[t.Unix()]
		b := bar{X: i * barW, Label: t.UTC().Format("15:04"), Completed: c[0], Fail: c[1]}
		if peak > 0 {
			b.Height = int((c[0] + c[1]) * chartH / peak)
			b.FailHeight = int(c[1] * chartH / peak)
		}
		b.Y = chartH - b.Height
		bars = append(bars, b)
	}
	h.render(w, r, http.StatusOK, "overview", map[string]any{
		"Title": "Overview", "Statuses": statusNames, "Rows": rows, "Scanned": scanned, "ScanCapped": scanned >= overviewSagaScan,
		"ScanLimit": overviewSagaScan, "FailureScan": overviewFailureScan, "Failed": failed, "Compensated": compensated, "Outbox": ob,
		"Bars": bars, "StepsLastHour": total, "FailsLastHour": fails, "Now": now,
		"Since": since, "HistoryScan": overviewHistoryScan,
	})
}

// filterFields are the list's query parameters, in the order of the form.
var filterFields = []string{"name", "status", "key", "code", "step", "after", "before", "waiting"}

// parseTime reads a filter's time: RFC 3339, or a form's local date-time
// (taken as UTC).
func parseTime(field, s string) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04:05", "2006-01-02T15:04", "2006-01-02"} {
		if t, err := time.Parse(layout, s); err == nil {
			return t, nil
		}
	}
	return time.Time{}, fmt.Errorf("%s: %q is not a time (use RFC 3339, such as 2026-01-02T15:04:05Z)", field, visible(s))
}

// listOpts reads the list's filters from q.
func listOpts(q url.Values) (saga.ListOpts, error) {
	o := saga.ListOpts{Name: q.Get("name"), BusinessKey: q.Get("key"), ErrorCode: q.Get("code"),
		FailedStep: q.Get("step"), Waiting: q.Get("waiting") != "", Cursor: q.Get("cursor")}
	for _, s := range q["status"] {
		if s == "" {
			continue
		}
		if !saga.Status(s).Valid() {
			return o, fmt.Errorf("status: %q is not one of %s", visible(s), strings.Join(statusNames, ", "))
		}
		o.Statuses = append(o.Statuses, saga.Status(s))
	}
	var err error
	if o.CreatedAfter, err = parseTime("after", q.Get("after")); err != nil {
		return o, err
	}
	if o.CreatedBefore, err = parseTime("before", q.Get("before")); err != nil {
		return o, err
	}
	o.Limit = PageSizeDefault
	if s := q.Get("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > saga.ListLimitMax {
			return o, fmt.Errorf("limit: %q is not a number from 1 to %d", visible(s), saga.ListLimitMax)
		}
		o.Limit = n
	}
	return o, nil
}

// filterQuery is q's filters alone, without the cursor.
func filterQuery(q url.Values) url.Values {
	out := url.Values{}
	for _, f := range append(filterFields, "limit") {
		for _, v := range q[f] {
			if v != "" {
				out.Add(f, v)
			}
		}
	}
	return out
}

func (h *Handler) list(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	// The whole query, "?" included: after the path, html/template keeps
	// its = and & (inside the query part it would escape them, and the
	// bulk replay would lose its filter: review26 F1).
	data := map[string]any{"Title": "Sagas", "Statuses": statusNames, "F": q, "BulkQuery": "?" + filterQuery(q).Encode(),
		"CanReplay": h.allowed(r, ActionReplay)}
	opts, err := listOpts(q)
	if err != nil {
		data["Error"] = err.Error()
		h.render(w, r, http.StatusBadRequest, "list", data)
		return
	}
	res, err := h.engine.List(r.Context(), &opts)
	if err != nil {
		if badRequest(err) {
			data["Error"] = err.Error()
			h.render(w, r, http.StatusBadRequest, "list", data)
			return
		}
		h.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	data["Sagas"] = res.Sagas
	if res.NextCursor != "" {
		next := filterQuery(q)
		next.Set("cursor", res.NextCursor)
		data["Next"] = "?" + next.Encode()
	}
	if q.Get("cursor") != "" {
		data["First"] = "?" + filterQuery(q).Encode()
	}
	h.render(w, r, http.StatusOK, "list", data)
}

// badRequest reports whether err is the caller's fault: a malformed cursor
// or a string PostgreSQL cannot take.
func badRequest(err error) bool {
	return errors.Is(err, store.ErrMalformedCursor) || errors.Is(err, saga.ErrInvalidInput)
}

// statusOf is 400 for the caller's fault and 500 for the rest.
func statusOf(err error) int {
	if badRequest(err) {
		return http.StatusBadRequest
	}
	return http.StatusInternalServerError
}

// stepBox is one step of the drawn definition.
type stepBox struct {
	Name        string
	Class       string // done, here, stopped, pending
	Compensable bool
	CompClass   string // undone, here, stopped, pending
	Remote      bool
}

// timelineRow is one entry of the saga's timeline.
type timelineRow struct {
	saga.Event
	Key      string
	Duration string
	Detail   string
	Class    string
}

func (h *Handler) loadSaga(w http.ResponseWriter, r *http.Request) (*saga.Instance, bool) {
	return h.loadSagaTx(w, r, nil)
}

// loadSagaTx is loadSaga in tx, when not nil.
func (h *Handler) loadSagaTx(w http.ResponseWriter, r *http.Request, tx pgx.Tx) (*saga.Instance, bool) {
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		h.fail(w, r, http.StatusBadRequest, fmt.Errorf("%q is not a saga id", visible(r.PathValue("id"))))
		return nil, false
	}
	var inst *saga.Instance
	if tx != nil {
		inst, err = h.engine.GetTx(r.Context(), tx, id)
	} else {
		inst, err = h.engine.Get(r.Context(), id)
	}
	if errors.Is(err, saga.ErrNotFound) {
		h.fail(w, r, http.StatusNotFound, fmt.Errorf("no saga %s", id))
		return nil, false
	}
	if err != nil {
		h.fail(w, r, http.StatusInternalServerError, err)
		return nil, false
	}
	return inst, true
}

// stepsOf returns the saga's steps: its registered definition's, else
// those its timeline shows (partial).
func (h *Handler) stepsOf(inst *saga.Instance) (steps []saga.StepInfo, partial bool) {
	if s, ok := h.engine.DefinitionSteps(inst.Name); ok {
		return s, false
	}
	return saga.HistorySteps(inst), true
}

func (h *Handler) sagaPage(w http.ResponseWriter, r *http.Request) {
	inst, ok := h.loadSaga(w, r)
	if !ok {
		return
	}
	defSteps, partial := h.stepsOf(inst)
	data := map[string]any{"Title": "Saga " + inst.ID.String(), "S": inst, "Partial": partial,
		"Boxes": boxes(inst, defSteps), "Timeline": timeline(inst), "Done": r.URL.Query().Get("done")}
	if h.cfg.Redact != nil {
		if shown := h.cfg.Redact(inst.Name, inst.State); shown != nil {
			var b bytes.Buffer
			if json.Indent(&b, shown, "", "  ") == nil {
				data["State"] = b.String()
			} else {
				data["State"] = string(shown)
			}
		}
	}
	var actions []string
	switch {
	case inst.Status == saga.StatusFailed:
		actions = []string{ActionResume, ActionRerun}
	case inst.Status.Terminal():
		actions = []string{ActionRerun}
	case inst.Status == saga.StatusRunning:
		actions = []string{ActionCancel}
	}
	switch {
	case inst.Status.Terminal():
	case inst.Paused == nil:
		actions = append(actions, ActionPause)
	case !inst.Paused.Type:
		actions = append(actions, ActionUnpause)
	}
	var allowed []string
	for _, a := range actions {
		if h.allowed(r, a) {
			allowed = append(allowed, a)
		}
	}
	data["Actions"] = allowed
	data["Steps"] = defSteps
	h.render(w, r, http.StatusOK, "saga", data)
}

// boxes draws the definition: which steps completed in the saga's current
// epoch, which were compensated, and where it is or stopped.
func boxes(inst *saga.Instance, defSteps []saga.StepInfo) []stepBox {
	done, undone := map[string]bool{}, map[string]bool{}
	for _, ev := range inst.History {
		if ev.Epoch != inst.Epoch {
			continue
		}
		switch ev.Type {
		case saga.EventStepCompleted, saga.EventStepDeduplicated:
			if ev.Direction == steps.Forward {
				done[ev.Step] = true
			}
		case saga.EventCompensationCompleted:
			undone[ev.Step] = true
		}
	}
	out := make([]stepBox, len(defSteps))
	for i, s := range defSteps {
		b := stepBox{Name: s.Name, Compensable: s.Compensable, Remote: s.Remote, Class: "pending", CompClass: "pending"}
		switch {
		case done[s.Name] || inst.Status == saga.StatusCompleted:
			b.Class = "done"
		case inst.LastError != nil && inst.LastError.Step == s.Name:
			// The step whose failure made the saga compensate.
			b.Class = "stopped"
		}
		if undone[s.Name] {
			b.CompClass = "undone"
		}
		if s.Name == inst.Step {
			mark := "here"
			if inst.Status == saga.StatusFailed {
				mark = "stopped"
			}
			if inst.Status == saga.StatusRunning || inst.Status == saga.StatusFailed || inst.Status == saga.StatusCompensating {
				if inst.Direction == steps.Compensate {
					b.CompClass = mark
				} else {
					b.Class = mark
				}
			}
		}
		out[i] = b
	}
	return out
}

func timeline(inst *saga.Instance) []timelineRow {
	out := make([]timelineRow, 0, len(inst.History))
	for _, ev := range inst.History {
		row := timelineRow{Event: ev}
		if ev.Step != "" && ev.Direction.Valid() {
			row.Key = steps.Key{SagaID: inst.ID, Step: ev.Step, Direction: ev.Direction, Epoch: ev.Epoch}.String()
		}
		if len(ev.Detail) > 0 {
			var d map[string]any
			if json.Unmarshal(ev.Detail, &d) == nil {
				if ms, ok := d["duration_ms"].(float64); ok {
					row.Duration = fmtDuration(time.Duration(ms * float64(time.Millisecond)))
					delete(d, "duration_ms")
				}
				if len(d) > 0 {
					b, _ := json.Marshal(d)
					row.Detail = string(b)
				}
			} else {
				row.Detail = string(ev.Detail)
			}
		}
		switch {
		case ev.ErrorCode != "" || strings.HasSuffix(ev.Type, "failed"):
			row.Class = "bad"
		case strings.HasSuffix(ev.Type, "completed") || ev.Type == saga.EventSagaCompensated:
			row.Class = "good"
		}
		out = append(out, row)
	}
	return out
}

// deadRow is a dead message or letter with its preview.
type deadRow struct {
	Msg     *saga.DeadMessage
	Letter  *saga.DeadLetter
	Preview []byte
	Shown   bool // Preview is what the redaction hook allowed
}

func (h *Handler) dead(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	q := r.URL.Query()
	msgs, err := h.engine.DeadMessages(ctx, &saga.DeadOpts{Cursor: q.Get("mcursor"), Limit: PageSizeDefault})
	if err != nil {
		h.fail(w, r, statusOf(err), err)
		return
	}
	letters, err := h.engine.DeadLetters(ctx, &saga.DeadOpts{Cursor: q.Get("lcursor"), Limit: PageSizeDefault})
	if err != nil {
		h.fail(w, r, statusOf(err), err)
		return
	}
	var mids []uuid.UUID
	for _, m := range msgs.Messages {
		mids = append(mids, m.ID)
	}
	var lids []int64
	for _, l := range letters.Letters {
		lids = append(lids, l.ID)
	}
	var payloads map[uuid.UUID][]byte
	var values map[int64][]byte
	if h.cfg.RedactPayload != nil {
		if payloads, err = h.st.DeadPayloads(ctx, h.pool, mids, h.cfg.PreviewBytes); err != nil {
			h.fail(w, r, http.StatusInternalServerError, err)
			return
		}
		if values, err = h.st.DeadLetterValues(ctx, h.pool, lids, h.cfg.PreviewBytes); err != nil {
			h.fail(w, r, http.StatusInternalServerError, err)
			return
		}
	}
	var mrows, lrows []deadRow
	for i := range msgs.Messages {
		m := &msgs.Messages[i]
		row := deadRow{Msg: m}
		if p, ok := payloads[m.ID]; ok {
			row.Preview = h.cfg.RedactPayload(m.Topic, p)
			row.Shown = row.Preview != nil
		}
		mrows = append(mrows, row)
	}
	for i := range letters.Letters {
		l := &letters.Letters[i]
		row := deadRow{Letter: l}
		if p, ok := values[l.ID]; ok {
			row.Preview = h.cfg.RedactPayload(l.Topic, p)
			row.Shown = row.Preview != nil
		}
		lrows = append(lrows, row)
	}
	data := map[string]any{"Title": "Dead messages and letters", "Messages": mrows, "Letters": lrows,
		"CanRequeue": h.allowed(r, ActionRequeue), "PreviewBytes": h.cfg.PreviewBytes, "PayloadsShown": h.cfg.RedactPayload != nil}
	if msgs.NextCursor != "" {
		data["NextMessages"] = link("", "mcursor", msgs.NextCursor, "lcursor", q.Get("lcursor"))
	}
	if letters.NextCursor != "" {
		data["NextLetters"] = link("", "mcursor", q.Get("mcursor"), "lcursor", letters.NextCursor)
	}
	h.render(w, r, http.StatusOK, "dead", data)
}
