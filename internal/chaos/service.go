package chaos

import (
	"net"
	"net/http"
	"strings"
	"sync"
)

// Service is the fake external service the step bodies call (a bank, a
// carrier). It honours Idempotency-Key as a real payment API does: the
// first call with a key has the effect, later calls with the same key only
// get the first answer back. It counts both, independently of the engine's
// tables.
type Service struct {
	srv *http.Server
	ln  net.Listener

	mu    sync.Mutex
	calls map[string]int // op + " " + key -> calls
}

// StartService listens on a free port of 127.0.0.1.
func StartService() (*Service, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &Service{ln: ln, calls: map[string]int{}}
	s.srv = &http.Server{Handler: http.HandlerFunc(s.serve)}
	go func() { _ = s.srv.Serve(ln) }()
	return s, nil
}

// URL is the service's base URL.
func (s *Service) URL() string { return "http://" + s.ln.Addr().String() }

// Close stops the service.
func (s *Service) Close() error { return s.srv.Close() }

func (s *Service) serve(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	if r.Method != http.MethodPost || key == "" {
		http.Error(w, "POST with an Idempotency-Key", http.StatusBadRequest)
		return
	}
	op := strings.TrimPrefix(r.URL.Path, "/")
	s.mu.Lock()
	s.calls[op+" "+key]++
	s.mu.Unlock()
	_, _ = w.Write([]byte(`{"ok":true}`))
}

// Effects returns, per operation and key, how many calls were made.
func (s *Service) Effects() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int, len(s.calls))
	for k, v := range s.calls {
		out[k] = v
	}
	return out
}
