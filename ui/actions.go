package ui

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"

	"github.com/google/uuid"

	"github.com/sagaflow/sagaflow/internal/store"
	"github.com/sagaflow/sagaflow/saga"
)

// planAction maps a saga page action to what PlanFor previews.
var planAction = map[string]saga.PlanAction{
	ActionResume: saga.PlanResume, ActionRerun: saga.PlanRerun, ActionCancel: saga.PlanCancel,
}

// simpleAction are the saga page actions that have no plan: a
// confirmation is all they show.
var simpleAction = map[string]string{
	ActionPause:   "No new step of this saga starts (no step, compensation, retry, timer or signal delivery) until it is unpaused; a step that runs now finishes.",
	ActionUnpause: "The saga continues where it paused: each held command becomes due when it was due, or now.",
}

// previewAction shows what an action on one saga will do, and the form
// that confirms it. It changes nothing.
func (h *Handler) previewAction(w http.ResponseWriter, r *http.Request) {
	action := r.PathValue("action")
	if what, ok := simpleAction[action]; ok {
		if err := h.authorize(r, action); err != nil {
			h.fail(w, r, http.StatusForbidden, err)
			return
		}
		inst, ok := h.loadSaga(w, r)
		if !ok {
			return
		}
		data := map[string]any{"Title": action + " " + inst.ID.String(), "S": inst, "Action": action, "Simple": what}
		// Offer the confirmation only where it applies (review26 O2).
		switch {
		case action == ActionPause && inst.Status.Terminal():
			data["Error"] = "the saga has ended: there is nothing to pause"
		case action == ActionPause && inst.Paused != nil:
			data["Error"] = "the saga is paused already"
		case action == ActionUnpause && (inst.Paused == nil || inst.Paused.Type):
			data["Error"] = "the saga is not paused on its own (a pause of its whole type is lifted with the type's)"
		}
		status := http.StatusOK
		if data["Error"] != nil {
			status = http.StatusConflict
		}
		h.render(w, r, status, "preview", data)
		return
	}
	pa, ok := planAction[action]
	if !ok {
		h.fail(w, r, http.StatusNotFound, fmt.Errorf("no action %q", visible(action)))
		return
	}
	if err := h.authorize(r, action); err != nil {
		h.fail(w, r, http.StatusForbidden, err)
		return
	}
	inst, ok := h.loadSaga(w, r)
	if !ok {
		return
	}
	defSteps, partial := h.stepsOf(inst)
	from := r.URL.Query().Get("from")
	data := map[string]any{"Title": action + " " + inst.ID.String(), "S": inst, "Action": action, "From": from,
		"Steps": defSteps, "Partial": partial}
	if action == ActionRerun && from == "" {
		// Choose the step first.
		h.render(w, r, http.StatusOK, "preview", data)
		return
	}
	plan, err := saga.PlanFor(inst, defSteps, partial, pa, from)
	if err != nil {
		data["Error"] = err.Error()
		h.render(w, r, http.StatusConflict, "preview", data)
		return
	}
	data["Plan"] = plan
	h.render(w, r, http.StatusOK, "preview", data)
}

// doAction performs a confirmed action on one saga and sends the browser
// back to the saga.
func (h *Handler) doAction(w http.ResponseWriter, r *http.Request) {
	action := r.PathValue("action")
	_, planned := planAction[action]
	_, simple := simpleAction[action]
	if !planned && !simple {
		h.fail(w, r, http.StatusNotFound, fmt.Errorf("no action %q", visible(action)))
		return
	}
	if status, err := h.checkWrite(r, action); err != nil {
		h.fail(w, r, status, err)
		return
	}
	if action == ActionRerun && r.PostFormValue("from") == "" {
		h.fail(w, r, http.StatusBadRequest, errors.New("from: a rerun needs the step to run from"))
		return
	}
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		h.fail(w, r, http.StatusBadRequest, fmt.Errorf("%q is not a saga id", visible(r.PathValue("id"))))
		return
	}
	ctx := r.Context()
	// One confirmation posted twice (a double click, a resent form) must
	// act once: the UI's actions on one saga take turns, across processes,
	// under a lock held until the action committed, and each checks the
	// version it was confirmed at once it has its turn. Everything happens
	// in the lock's transaction: an action that held one connection and
	// waited for another could starve the pool.
	tx, err := h.pool.Begin(ctx)
	if err != nil {
		h.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	// The lock is the saga's, not its spelling's (uuid.Parse takes upper
	// case, braces and urn:uuid: too).
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended($1, 0))`, "sagaflow-ui/"+h.cfg.Schema+"/"+id.String()); err != nil {
		h.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	inst, ok := h.loadSagaTx(w, r, tx)
	if !ok {
		return
	}
	// The plan the operator confirmed was computed from a version of the
	// saga; one that moved on since needs a new look.
	if v := r.PostFormValue("version"); v != strconv.FormatInt(inst.Version, 10) {
		h.fail(w, r, http.StatusConflict, fmt.Errorf("the saga changed since the preview (version %s, now %d): preview it again",
			visible(v), inst.Version))
		return
	}
	reason := h.reason(r, action)
	switch action {
	case ActionResume:
		// Resume of a paused saga lifts its pause, which is unpause's to
		// do and to be allowed (review26 F2); resume is for failed sagas.
		switch {
		case inst.Paused != nil:
			err = fmt.Errorf("saga %s is paused: unpause it (a resume would lift the pause): %w", inst.ID, saga.ErrNotReplayable)
		case inst.Status != saga.StatusFailed:
			err = fmt.Errorf("saga %s is %s, not failed: %w", inst.ID, inst.Status, saga.ErrNotReplayable)
		default:
			err = h.engine.ResumeTx(ctx, tx, inst.ID, reason)
		}
	case ActionRerun:
		err = h.engine.RerunTx(ctx, tx, inst.ID, r.PostFormValue("from"), reason)
	case ActionPause:
		err = h.engine.PauseTx(ctx, tx, inst.ID, reason)
	case ActionUnpause:
		err = h.engine.UnpauseTx(ctx, tx, inst.ID, reason)
	case ActionCancel:
		// A cancel recorded and not yet applied (a step runs) leaves the
		// version as it was: a second confirmation finds the request.
		var pending map[uuid.UUID]store.CancelRequest
		if pending, err = h.st.CancelRequests(ctx, tx, []uuid.UUID{inst.ID}); err == nil && len(pending) > 0 {
			err = fmt.Errorf("a cancel of saga %s is already requested; it is applied when its running step ends: %w", inst.ID, saga.ErrNotRunning)
		}
		if err == nil {
			if _, known := h.engine.DefinitionSteps(inst.Name); known {
				err = h.engine.CancelTx(ctx, tx, inst.ID, reason)
			} else {
				err = h.engine.RequestCancelTx(ctx, tx, inst.ID, reason)
			}
		}
	}
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		status := http.StatusInternalServerError
		if errors.Is(err, saga.ErrNotReplayable) || errors.Is(err, saga.ErrNotRunning) || errors.Is(err, saga.ErrNotPaused) ||
			errors.Is(err, saga.ErrInvalidInput) {
			status = http.StatusConflict
		} else if errors.Is(err, saga.ErrNotFound) {
			status = http.StatusNotFound
		} else if r.PostFormValue("from") != "" {
			// Rerun names a step the saga does not have.
			status = http.StatusBadRequest
		}
		h.fail(w, r, status, err)
		return
	}
	http.Redirect(w, r, h.cfg.Prefix+"/sagas/"+inst.ID.String()+"?done="+url.QueryEscape(action), http.StatusSeeOther)
}

// bulkOpts reads a bulk replay's selection from v.
func bulkOpts(v url.Values) (saga.BulkReplayOpts, error) {
	lo, err := listOpts(v)
	if err != nil {
		return saga.BulkReplayOpts{}, err
	}
	o := saga.BulkReplayOpts{Name: lo.Name, Statuses: lo.Statuses, CreatedAfter: lo.CreatedAfter, CreatedBefore: lo.CreatedBefore,
		FailedStep: lo.FailedStep, ErrorCode: lo.ErrorCode, FromStep: v.Get("from")}
	if lo.BusinessKey != "" {
		return o, errors.New("key: a bulk replay does not select by business key; open the saga instead")
	}
	if lo.Waiting {
		return o, errors.New("waiting: waiting sagas are running, and a bulk replay takes failed or ended ones")
	}
	if s := v.Get("max"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > saga.BulkReplayMaxLimit {
			return o, fmt.Errorf("max: %q is not a number from 1 to %d", visible(s), saga.BulkReplayMaxLimit)
		}
		o.Max = n
	}
	// The sagas the preview listed: the confirmation replays those (that
	// the filter still selects), not what the filter selects by then.
	if ids := v["id"]; len(ids) > 0 {
		if len(ids) > saga.BulkReplayMaxLimit {
			return o, fmt.Errorf("id: at most %d sagas at once", saga.BulkReplayMaxLimit)
		}
		for _, s := range ids {
			id, err := uuid.Parse(s)
			if err != nil {
				return o, fmt.Errorf("id: %q is not a saga id", visible(s))
			}
			o.IDs = append(o.IDs, id)
		}
	}
	return o, nil
}

// previewBulk runs a bulk replay as a dry run and shows what it selected,
// with the form that runs it.
func (h *Handler) previewBulk(w http.ResponseWriter, r *http.Request) {
	if err := h.authorize(r, ActionReplay); err != nil {
		h.fail(w, r, http.StatusForbidden, err)
		return
	}
	q := r.URL.Query()
	data := map[string]any{"Title": "Bulk replay", "F": q, "DryRun": true}
	o, err := bulkOpts(q)
	if err != nil {
		data["Error"] = err.Error()
		h.render(w, r, http.StatusBadRequest, "bulk", data)
		return
	}
	o.DryRun = true
	res, err := h.engine.ReplayBulk(r.Context(), o)
	if err != nil {
		data["Error"] = err.Error()
		h.render(w, r, http.StatusBadRequest, "bulk", data)
		return
	}
	data["Result"] = res
	limit := o.Max
	if limit == 0 {
		limit = saga.BulkReplayMaxDefault
	}
	data["Cap"], data["Capped"] = limit, len(res.Matched)+len(res.Errors) >= limit
	hidden := hiddenFields(q, append(filterFields, "from", "max"))
	for _, id := range res.Matched {
		hidden = append(hidden, hiddenField{"id", id.String()})
	}
	data["Hidden"] = hidden
	h.render(w, r, http.StatusOK, "bulk", data)
}

// doBulk runs a confirmed bulk replay and shows its result.
func (h *Handler) doBulk(w http.ResponseWriter, r *http.Request) {
	if status, err := h.checkWrite(r, ActionReplay); err != nil {
		h.fail(w, r, status, err)
		return
	}
	data := map[string]any{"Title": "Bulk replay", "F": r.PostForm}
	o, err := bulkOpts(r.PostForm)
	if err != nil {
		data["Error"] = err.Error()
		h.render(w, r, http.StatusBadRequest, "bulk", data)
		return
	}
	o.Reason = h.reason(r, "bulk replay")
	res, err := h.engine.ReplayBulk(r.Context(), o)
	if err != nil && res == nil {
		data["Error"] = err.Error()
		h.render(w, r, http.StatusBadRequest, "bulk", data)
		return
	}
	data["Result"] = res
	if err != nil {
		data["Error"] = err.Error()
	}
	h.render(w, r, http.StatusOK, "bulk", data)
}

// requeueOpts reads which dead items to requeue: "msg" outbox row ids and
// "letter" dead letter ids.
func requeueOpts(v url.Values) (*saga.RequeueOpts, error) {
	o := &saga.RequeueOpts{}
	for _, s := range v["msg"] {
		id, err := uuid.Parse(s)
		if err != nil {
			return nil, fmt.Errorf("msg: %q is not a message id", visible(s))
		}
		o.MessageIDs = append(o.MessageIDs, id)
	}
	for _, s := range v["letter"] {
		id, err := strconv.ParseInt(s, 10, 64)
		if err != nil || id < 1 {
			return nil, fmt.Errorf("letter: %q is not a dead letter id", visible(s))
		}
		o.LetterIDs = append(o.LetterIDs, id)
	}
	if len(o.MessageIDs)+len(o.LetterIDs) == 0 {
		return nil, errors.New("nothing selected to requeue")
	}
	if len(o.MessageIDs)+len(o.LetterIDs) > saga.RequeueMaxLimit {
		return nil, fmt.Errorf("at most %d items can be requeued at once", saga.RequeueMaxLimit)
	}
	return o, nil
}

// previewRequeue requeues as a dry run (in a transaction that is rolled
// back) and shows what would happen, with the form that does it.
func (h *Handler) previewRequeue(w http.ResponseWriter, r *http.Request) {
	if err := h.authorize(r, ActionRequeue); err != nil {
		h.fail(w, r, http.StatusForbidden, err)
		return
	}
	q := r.URL.Query()
	data := map[string]any{"Title": "Requeue", "DryRun": true}
	o, err := requeueOpts(q)
	if err != nil {
		data["Error"] = err.Error()
		h.render(w, r, http.StatusBadRequest, "requeue", data)
		return
	}
	o.DryRun = true
	res, err := h.engine.RequeueDead(r.Context(), o)
	if err != nil {
		h.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	data["Result"] = res
	data["Hidden"] = hiddenFields(q, []string{"msg", "letter"})
	h.render(w, r, http.StatusOK, "requeue", data)
}

// doRequeue requeues the confirmed dead items and shows the result.
func (h *Handler) doRequeue(w http.ResponseWriter, r *http.Request) {
	if status, err := h.checkWrite(r, ActionRequeue); err != nil {
		h.fail(w, r, status, err)
		return
	}
	data := map[string]any{"Title": "Requeue"}
	o, err := requeueOpts(r.PostForm)
	if err != nil {
		data["Error"] = err.Error()
		h.render(w, r, http.StatusBadRequest, "requeue", data)
		return
	}
	o.Reason = h.reason(r, "requeue")
	res, err := h.engine.RequeueDead(r.Context(), o)
	if err != nil && res == nil {
		h.fail(w, r, http.StatusInternalServerError, err)
		return
	}
	data["Result"] = res
	if err != nil {
		data["Error"] = err.Error()
	}
	h.cfg.Logger.Info("ui: requeued dead items", "by", h.actor(r), "messages", len(res.Messages), "letters", len(res.Letters),
		"message_ids", o.MessageIDs, "letter_ids", o.LetterIDs)
	h.render(w, r, http.StatusOK, "requeue", data)
}

// hiddenField is a name and value carried from a preview to its confirm.
type hiddenField struct{ Name, Value string }

func hiddenFields(q url.Values, names []string) []hiddenField {
	var out []hiddenField
	for _, n := range names {
		for _, v := range q[n] {
			if v != "" {
				out = append(out, hiddenField{n, v})
			}
		}
	}
	return out
}
