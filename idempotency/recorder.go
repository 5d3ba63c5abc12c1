package idempotency

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"net/http"
	"slices"
)

// recorder writes a handler's response through to the client and keeps a
// copy of it: the status, the replayable headers as they were when the
// status was written, and the body, unless the response is streamed or
// larger than maxBody.
type recorder struct {
	w             http.ResponseWriter
	replayHeaders []string // canonical names
	maxBody       int64

	status  int // 0 until the final status is written
	headers map[string][]string
	body    bytes.Buffer
	size    int64
	// omitted says why the body is not kept ("" while it is).
	omitted string
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

// Write passes p on to the client and keeps a copy while the body is kept.
func (rec *recorder) Write(p []byte) (int, error) {
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	rec.size += int64(len(p))
	if rec.omitted == "" && rec.size > rec.maxBody {
		rec.omit(fmt.Sprintf("larger than %d bytes", rec.maxBody))
	}
	if rec.omitted == "" {
		rec.body.Write(p)
	}
	return rec.w.Write(p)
}

// Flush sends what was written so far. A flushed response is streamed: the
// client may act on part of it, so it is not kept to be replayed whole.
func (rec *recorder) Flush() {
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	rec.omit("streamed (flushed)")
	_ = http.NewResponseController(rec.w).Flush()
}

// Hijack hands the connection to the handler; what it sends then is not
// seen here, so the response is not kept.
func (rec *recorder) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, rw, err := http.NewResponseController(rec.w).Hijack()
	if err == nil {
		rec.omit("hijacked")
	}
	return conn, rw, err
}

// Unwrap lets [http.ResponseController] reach the client's writer for what
// the recorder does not implement (deadlines, full duplex).
func (rec *recorder) Unwrap() http.ResponseWriter { return rec.w }

func (rec *recorder) omit(why string) {
	if rec.omitted == "" {
		rec.omitted = why
		rec.body = bytes.Buffer{} // let the copy go
	}
}

// finish returns the response to store as the client got it, also when the
// handler wrote nothing (net/http then sends 200 with the headers set by
// then).
func (rec *recorder) finish() *Response {
	if rec.status == 0 {
		rec.status = http.StatusOK
		rec.snapshotHeaders()
	}
	if rec.omitted != "" {
		return &Response{Status: rec.status, Headers: rec.headers, Body: []byte{}, BodyOmitted: true}
	}
	return &Response{Status: rec.status, Headers: rec.headers, Body: rec.body.Bytes()}
}

func (rec *recorder) snapshotHeaders() {
	rec.headers = map[string][]string{}
	h := rec.w.Header()
	for _, name := range rec.replayHeaders {
		// Every byte of every value is kept (the stores escape what they
		// cannot hold as it is): a replay without its ETag or Location, or
		// with another Content-Type, is another response.
		if vs := h[name]; len(vs) > 0 {
			rec.headers[name] = slices.Clone(vs)
		}
	}
}
