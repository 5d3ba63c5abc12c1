package idempotency

import (
	"bytes"
	"net/http"
	"strings"
	"unicode/utf8"
)

// recorder writes a handler's response through to the client and keeps a
// copy of it: the status, the replayable headers as they were when the
// status was written, and the whole body.
type recorder struct {
	w             http.ResponseWriter
	replayHeaders []string // canonical names

	status  int // 0 until the final status is written
	headers map[string][]string
	body    bytes.Buffer
}

func (rec *recorder) Header() http.Header { return rec.w.Header() }

func (rec *recorder) WriteHeader(code int) {
	if rec.status != 0 {
		rec.w.WriteHeader(code) // net/http logs the superfluous call
		return
	}
	if code >= 100 && code < 200 && code != http.StatusSwitchingProtocols {
		rec.w.WriteHeader(code) // informational: the final status comes later
		return
	}
	rec.status = code
	rec.snapshotHeaders()
	rec.w.WriteHeader(code)
}

// Write records all of p, whatever reached the client: the stored response
// is the one the handler produced.
func (rec *recorder) Write(p []byte) (int, error) {
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	rec.body.Write(p)
	return rec.w.Write(p)
}

// Flush sends what was written so far.
func (rec *recorder) Flush() {
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	_ = http.NewResponseController(rec.w).Flush()
}

// Unwrap lets [http.ResponseController] reach the client's writer.
func (rec *recorder) Unwrap() http.ResponseWriter { return rec.w }

// finish returns the response as the client got it, also when the handler
// wrote nothing (net/http then sends 200 with the headers set by then).
func (rec *recorder) finish() (int, map[string][]string, []byte) {
	if rec.status == 0 {
		rec.status = http.StatusOK
		rec.snapshotHeaders()
	}
	return rec.status, rec.headers, rec.body.Bytes()
}

func (rec *recorder) snapshotHeaders() {
	rec.headers = map[string][]string{}
	h := rec.w.Header()
	for _, name := range rec.replayHeaders {
		var vs []string
		for _, v := range h[name] {
			// Stored as jsonb, which holds valid UTF-8 without NUL only.
			if utf8.ValidString(v) && !strings.ContainsRune(v, 0) {
				vs = append(vs, v)
			}
		}
		if len(vs) > 0 {
			rec.headers[name] = vs
		}
	}
}
