package review25_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/idempotency"
	"github.com/sagaflow/sagaflow/idempotency/redisstore"
	"github.com/sagaflow/sagaflow/internal/pgtest"
)

// "The same key while the first request is still in flight: 409 Conflict
// with Retry-After: 1"; the handler runs once and the retry after it gets
// the stored response.
func TestDuplicateInFlightGets409(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			g := newGate()
			rg := newRig(t, kind, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				g.wait()
				echo(&c)(w, r)
			}))
			done := make(chan res, 1)
			go func() { done <- rg.do(t, q{key: "k", user: "alice", body: []byte("A")}) }()
			g.waitEntered(t)
			r := rg.do(t, q{key: "k", user: "alice", body: []byte("A")})
			requireJSONError(t, r.status, r.hdr, r.body, http.StatusConflict, "duplicate in flight")
			require.Equal(t, "1", r.hdr.Get("Retry-After"))
			// with another body while in flight: the docs name 409 for "the same
			// key while ... in flight" and 422 for "a different request"; either
			// is a refusal, never a run.
			r = rg.do(t, q{key: "k", user: "alice", body: []byte("B")})
			require.Contains(t, []int{http.StatusConflict, http.StatusUnprocessableEntity}, r.status)
			t.Logf("%s: another body while in flight gets %d", kind, r.status)
			g.release()
			first := <-done
			require.Equal(t, http.StatusCreated, first.status)
			r = rg.settle(t, q{key: "k", user: "alice", body: []byte("A")})
			require.Equal(t, http.StatusCreated, r.status)
			require.Equal(t, "true", r.hdr.Get(idempotency.HeaderReplayed))
			require.Equal(t, string(first.body), string(r.body))
			require.Equal(t, int64(1), c.get())
		})
	}
}

// Sixteen copies of one request at once: one handler run; the others get
// 409 (or, once it is stored, the replay).
func TestBurstOfDuplicatesRunsOnce(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				time.Sleep(300 * time.Millisecond)
				echo(&c)(w, r)
			}))
			const n = 16
			start := make(chan struct{})
			out := make(chan res, n)
			var wg sync.WaitGroup
			for i := 0; i < n; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					out <- rg.do(t, q{key: "burst", user: "alice", body: []byte("A")})
				}()
			}
			close(start)
			wg.Wait()
			close(out)
			created, conflicts := 0, 0
			for r := range out {
				require.NoError(t, r.err)
				switch {
				case r.status == http.StatusCreated && r.hdr.Get(idempotency.HeaderReplayed) == "":
					created++
				case r.status == http.StatusConflict:
					conflicts++
				case r.status == http.StatusCreated:
				default:
					t.Fatalf("unexpected %d %q", r.status, r.body)
				}
			}
			require.Equal(t, 1, created)
			require.Equal(t, int64(1), c.get())
			t.Logf("%s: %d conflicts", kind, conflicts)
		})
	}
}

// "When the handler ... answers with a status that asks for a retry (5xx,
// 408 Request Timeout, 429 Too Many Requests), the key is deleted instead of
// stored"; other statuses, 4xx included, are stored and replayed.
func TestRetryableStatusesReleaseOthersAreKept(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			seq := []int{500, 503, 408, 429, 502, 599, 201}
			rg := newRig(t, kind, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				n := c.inc()
				if r.URL.Path == "/kept" {
					st := map[string]int{"a": 400, "b": 404, "c": 409, "d": 422, "e": 302, "f": 204, "g": 499}[r.Header.Get(idempotency.HeaderDefault)]
					w.WriteHeader(st)
					if st != 204 {
						_, _ = fmt.Fprintf(w, "run %d", n)
					}
					return
				}
				w.WriteHeader(seq[n-1])
				_, _ = fmt.Fprintf(w, "run %d", n)
			}))
			for i, st := range seq {
				r := rg.settle(t, q{key: "retry", user: "alice", body: []byte("A")})
				require.Equal(t, st, r.status, "request %d", i)
				require.Empty(t, r.hdr.Get(idempotency.HeaderReplayed), "request %d", i)
			}
			r := rg.settle(t, q{key: "retry", user: "alice", body: []byte("A")})
			require.Equal(t, 201, r.status)
			require.Equal(t, "true", r.hdr.Get(idempotency.HeaderReplayed))
			require.Equal(t, fmt.Sprintf("run %d", len(seq)), string(r.body))
			require.Equal(t, int64(len(seq)), c.get())

			for _, k := range []string{"a", "b", "c", "d", "e", "f", "g"} {
				r1 := rg.do(t, q{path: "/kept", key: k, user: "alice"})
				r2 := rg.settle(t, q{path: "/kept", key: k, user: "alice"})
				require.Equal(t, r1.status, r2.status, "key %s", k)
				require.Equal(t, "true", r2.hdr.Get(idempotency.HeaderReplayed), "a %d was not kept", r1.status)
				require.Equal(t, string(r1.body), string(r2.body))
			}
		})
	}
}

type boom struct{ n int }

// "When the handler panics ... the key is deleted ... The panic itself goes
// on to net/http."
func TestPanicReleasesTheKeyAndPropagates(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				n := c.inc()
				switch n {
				case 1:
					panic(boom{1})
				case 2:
					w.WriteHeader(http.StatusCreated)
					_, _ = w.Write([]byte("half"))
					panic(boom{2})
				case 3:
					panic(http.ErrAbortHandler)
				}
				w.WriteHeader(http.StatusCreated)
				_, _ = fmt.Fprintf(w, "run %d", n)
			}))
			for i, want := range []any{boom{1}, boom{2}, http.ErrAbortHandler} {
				var got any
				func() {
					defer func() { got = recover() }()
					rg.serveDirect(rawReq(http.MethodPost, "/orders", "", "p", "alice", []byte("A")))
				}()
				require.Equal(t, want, got, "panic %d did not go on as it was", i)
			}
			rec := rg.serveDirect(rawReq(http.MethodPost, "/orders", "", "p", "alice", []byte("A")))
			require.Equal(t, http.StatusCreated, rec.Code, rec.Body.String())
			require.Equal(t, "run 4", rec.Body.String())
			rec = rg.serveDirect(rawReq(http.MethodPost, "/orders", "", "p", "alice", []byte("A")))
			require.Equal(t, "true", rec.Header().Get(idempotency.HeaderReplayed))
			require.Equal(t, int64(4), c.get())
		})
	}
}

// A panic over a real connection: the client sees the connection fail; its
// retry runs the handler again.
func TestPanicOverTheWire(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if c.inc() == 1 {
					panic(http.ErrAbortHandler) // no stack in the test log
				}
				w.WriteHeader(http.StatusCreated)
			}))
			req := rg.build(t, q{key: "p", user: "alice", body: []byte("A")})
			// no automatic resend by the transport: use a fresh request body
			// that cannot be rewound.
			req.GetBody = nil
			_, err := rg.client.Do(req)
			require.Error(t, err)
			r := rg.settle(t, q{key: "p", user: "alice", body: []byte("A")})
			require.Equal(t, http.StatusCreated, r.status, "%d %s", r.status, r.body)
			require.Empty(t, r.hdr.Get(idempotency.HeaderReplayed))
			require.Equal(t, int64(2), c.get())
		})
	}
}

// The status the client got is the status kept: a WriteHeader after the
// response began is ignored by net/http, and an informational 1xx is not the
// final status; a handler that writes nothing answered 200.
func TestTheStatusKeptIsTheStatusSent(t *testing.T) {
	t.Parallel()
	cases := map[string]struct {
		h    func(w http.ResponseWriter)
		want int
		body string
	}{
		"write then 500": {func(w http.ResponseWriter) {
			_, _ = w.Write([]byte("created"))
			w.WriteHeader(http.StatusInternalServerError)
		}, 200, "created"},
		"201 then 503": {func(w http.ResponseWriter) {
			w.WriteHeader(http.StatusCreated)
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte("created"))
		}, 201, "created"},
		"103 then 201": {func(w http.ResponseWriter) {
			w.Header().Set("Link", "</style.css>; rel=preload")
			w.WriteHeader(http.StatusEarlyHints)
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte("created"))
		}, 201, "created"},
		"nothing": {func(http.ResponseWriter) {}, 200, ""},
	}
	for _, kind := range kinds {
		for name, tc := range cases {
			t.Run(kind+"/"+name, func(t *testing.T) {
				t.Parallel()
				var c counter
				rg := newRig(t, kind, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					c.inc()
					tc.h(w)
				}))
				r1 := rg.do(t, q{key: "s", user: "alice"})
				require.NoError(t, r1.err)
				require.Equal(t, tc.want, r1.status, "net/http sent")
				r2 := rg.settle(t, q{key: "s", user: "alice"})
				require.Equal(t, int64(1), c.get(), "the handler ran again after the client got %d", tc.want)
				require.Equal(t, tc.want, r2.status)
				require.Equal(t, "true", r2.hdr.Get(idempotency.HeaderReplayed))
				require.Equal(t, tc.body, string(r2.body))
			})
		}
	}
}

// A client that goes away while the handler runs: the handler finishes the
// operation and answers; "the response is stored after it returned" and
// "the stored body is what the handler wrote, whatever reached the client".
// The retry must get that response, and the handler must not run again.
func TestClientDisconnectMidRequest(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			entered := make(chan struct{}, 1)
			returned := make(chan struct{}, 4)
			rg := newRig(t, kind, &idempotency.Config{InFlightTimeout: time.Second}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				defer func() { returned <- struct{}{} }()
				n := c.inc()
				if n == 1 {
					entered <- struct{}{}
					<-r.Context().Done() // the client is gone; the order is placed anyway
				}
				w.WriteHeader(http.StatusCreated)
				_, _ = fmt.Fprintf(w, "order %d", n)
			}))
			ctx, cancel := context.WithCancel(context.Background())
			req := rg.build(t, q{key: "d", user: "alice", body: []byte("A")}).WithContext(ctx)
			errc := make(chan error, 1)
			go func() {
				resp, err := rg.client.Do(req)
				if err == nil {
					resp.Body.Close()
				}
				errc <- err
			}()
			<-entered
			cancel()
			require.Error(t, <-errc)
			<-returned
			time.Sleep(100 * time.Millisecond)
			// retries for up to 2.5 s: past the 1 s InFlightTimeout.
			var last res
			for deadline := time.Now().Add(2500 * time.Millisecond); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
				last = rg.do(t, q{key: "d", user: "alice", body: []byte("A")})
				if last.status != http.StatusConflict {
					break
				}
			}
			require.Equal(t, int64(1), c.get(), "the handler ran again: the retry got %d %q", last.status, last.body)
			require.Equal(t, http.StatusCreated, last.status, "%q", last.body)
			require.Equal(t, "true", last.hdr.Get(idempotency.HeaderReplayed))
			require.Equal(t, "order 1", string(last.body))
		})
	}
}

// A client that dies while sending its body: the handler does not run, and
// nothing is left held, so the retry with the whole body runs once.
func TestDisconnectDuringBodyUpload(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			rg := newRig(t, kind, nil, echo(&c))
			conn, err := net.Dial("tcp", strings.TrimPrefix(rg.srv.URL, "http://"))
			require.NoError(t, err)
			_, err = fmt.Fprintf(conn, "POST /orders HTTP/1.1\r\nHost: x\r\nX-User: alice\r\nIdempotency-Key: up\r\nContent-Length: 1000\r\n\r\n0123456789")
			require.NoError(t, err)
			time.Sleep(100 * time.Millisecond)
			require.NoError(t, conn.Close())
			time.Sleep(200 * time.Millisecond)
			require.Zero(t, c.get(), "the handler ran on a truncated body")
			body := []byte(strings.Repeat("0123456789", 100))
			r := rg.do(t, q{key: "up", user: "alice", body: body})
			require.Equal(t, http.StatusCreated, r.status, "after a broken upload the key gave %d %q", r.status, r.body)
			require.Equal(t, 1000, decodeEcho(t, r.body).Len)
			r = rg.settle(t, q{key: "up", user: "alice", body: body})
			require.Equal(t, "true", r.hdr.Get(idempotency.HeaderReplayed))
			require.Equal(t, int64(1), c.get())
		})
	}
}

// A request still running after InFlightTimeout may run a second time (as
// documented); but the late first one is fenced: it can neither overwrite the
// second's stored response, nor free the second's key, nor complete it while
// the second is still running.
func TestLateFinisherIsFenced(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		for _, late := range []string{"201", "503", "while-second-in-flight"} {
			t.Run(kind+"/"+late, func(t *testing.T) {
				t.Parallel()
				g1, g2 := newGate(), newGate()
				var c counter
				rg := newRig(t, kind, &idempotency.Config{InFlightTimeout: time.Second}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					n := c.inc()
					switch {
					case n == 1:
						g1.wait()
						if late == "503" {
							http.Error(w, "late failure", http.StatusServiceUnavailable)
							return
						}
						w.WriteHeader(http.StatusCreated)
						_, _ = w.Write([]byte("late first"))
						return
					case n == 2 && late == "while-second-in-flight":
						g2.wait()
					}
					w.WriteHeader(http.StatusCreated)
					_, _ = fmt.Fprintf(w, "second %d", n)
				}))
				first := make(chan res, 1)
				go func() { first <- rg.do(t, q{key: "f", user: "alice", body: []byte("A")}) }()
				g1.waitEntered(t)
				time.Sleep(1300 * time.Millisecond)
				second := make(chan res, 1)
				go func() { second <- rg.do(t, q{key: "f", user: "alice", body: []byte("B")}) }()
				if late == "while-second-in-flight" {
					g2.waitEntered(t)
					g1.release()
					require.Equal(t, http.StatusCreated, (<-first).status)
					time.Sleep(100 * time.Millisecond)
					r := rg.do(t, q{key: "f", user: "alice", body: []byte("B")})
					require.Equal(t, http.StatusConflict, r.status, "while the second runs, a retry got %d %q", r.status, r.body)
					r = rg.do(t, q{key: "f", user: "alice", body: []byte("A")})
					require.NotEqual(t, "true", r.hdr.Get(idempotency.HeaderReplayed), "the late first completed the second's claim: %d %q", r.status, r.body)
					g2.release()
					require.Equal(t, http.StatusCreated, (<-second).status)
				} else {
					s := <-second
					require.Equal(t, http.StatusCreated, s.status, "after InFlightTimeout the key counts as absent")
					require.Equal(t, "second 2", string(s.body))
					g1.release()
					<-first
					time.Sleep(100 * time.Millisecond)
				}
				r := rg.settle(t, q{key: "f", user: "alice", body: []byte("B")})
				require.Equal(t, http.StatusCreated, r.status, "%q", r.body)
				require.Equal(t, "true", r.hdr.Get(idempotency.HeaderReplayed), "the late first freed or replaced the second's key: %d %q", r.status, r.body)
				require.Equal(t, "second 2", string(r.body))
				r = rg.do(t, q{key: "f", user: "alice", body: []byte("A")})
				requireJSONError(t, r.status, r.hdr, r.body, http.StatusUnprocessableEntity, "the first's body after the second's response was stored")
				require.Equal(t, int64(2), c.get())
			})
		}
	}
}

// "The database cannot be reached before the handler: 503 Service
// Unavailable with Retry-After: 1; the handler does not run."
func TestUnreachableStoreIs503(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			cfg := &idempotency.Config{Identity: identityFromContext, Logger: discard()}
			mw := unreachable(t, kind, cfg)
			h := auth(mw.Wrap(echo(&c)))
			rec := serveRec(h, rawReq(http.MethodPost, "/orders", "", "k", "alice", []byte("A")))
			requireJSONError(t, rec.Code, rec.Header(), rec.Body.Bytes(), http.StatusServiceUnavailable, kind)
			require.Equal(t, "1", rec.Header().Get("Retry-After"))
			require.Zero(t, c.get())
		})
	}
}

// Two replicas (two middlewares, each with its own pool or client) on one
// store: a burst of one request spread over both runs the handler once.
func TestTwoReplicasShareTheirKeys(t *testing.T) {
	t.Parallel()
	for _, kind := range kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var c counter
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				time.Sleep(200 * time.Millisecond)
				echo(&c)(w, r)
			})
			a := newIsolatedRig(t, kind, nil, h)
			cfg := &idempotency.Config{Identity: identityFromContext, Logger: discard()}
			var mw2 *idempotency.Middleware
			var err error
			if kind == "pg" {
				pool2, _ := pgtest.NewSchema(t) // a second pool to the same server
				cfg.Schema = a.db.Schema
				mw2, err = idempotency.New(pool2, cfg)
			} else {
				rdb2 := redis.NewClient(&redis.Options{Addr: redisAddr()})
				t.Cleanup(func() { _ = rdb2.Close() })
				st, serr := redisstore.New(rdb2, a.prefix)
				require.NoError(t, serr)
				cfg.Store = st
				mw2, err = idempotency.New(nil, cfg)
			}
			require.NoError(t, err)
			h2 := auth(mw2.Wrap(h))
			const n = 12
			start := make(chan struct{})
			codes := make(chan int, n)
			var wg sync.WaitGroup
			for i := 0; i < n; i++ {
				wg.Add(1)
				go func(i int) {
					defer wg.Done()
					<-start
					r := rawReq(http.MethodPost, "/orders", "", "replica", "alice", []byte("A"))
					var rec *httptest.ResponseRecorder
					if i%2 == 0 {
						rec = a.serveDirect(r)
					} else {
						rec = serveRec(h2, r)
					}
					codes <- rec.Code
				}(i)
			}
			close(start)
			wg.Wait()
			close(codes)
			for code := range codes {
				require.Contains(t, []int{http.StatusCreated, http.StatusConflict}, code)
			}
			require.Equal(t, int64(1), c.get(), "the handler ran on both replicas")
			rec := serveRec(h2, rawReq(http.MethodPost, "/orders", "", "replica", "alice", []byte("A")))
			require.Equal(t, "true", rec.Header().Get(idempotency.HeaderReplayed))
		})
	}
}
