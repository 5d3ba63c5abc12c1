package consume

import (
	"sync"
	"time"

	"github.com/sagaflow/sagaflow/health"
)

// FailureFresh is how long after a failed fetch a [FetchHealth] check
// stays not OK: longer than the longest wait before a loop tries a fetch
// again (a few seconds, kafka-go's own group join backoff included), so
// that a fetch that keeps failing keeps it not OK, and one that no longer
// fails lets it go. A fetch that waits for a message reports nothing until
// one comes, so a failure older than this is one that stopped.
const FailureFresh = 30 * time.Second

// FetchHealth follows a loop's fetches for a health check: set its
// Fetched as the [Loop]'s OnFetch. The zero value is ready to use and safe
// for concurrent use.
type FetchHealth struct {
	mu  sync.Mutex
	err error     // of the last fetch; nil when it brought a message
	at  time.Time // of the last fetch reported
}

// Fetched records the outcome of a fetch.
func (f *FetchHealth) Fetched(err error) {
	f.mu.Lock()
	f.at, f.err = time.Now(), err
	f.mu.Unlock()
}

// Check is the health check named name: not OK, with the error, when the
// last fetch failed less than [FailureFresh] ago.
func (f *FetchHealth) Check(name string) health.Check {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err == nil {
		return health.Check{Name: name, OK: true, Detail: "no fetch has failed"}
	}
	ago := time.Since(f.at)
	return health.Check{Name: name, OK: ago >= FailureFresh,
		Detail: "the last fetch failed " + ago.Round(time.Millisecond).String() + " ago: " + f.err.Error()}
}
