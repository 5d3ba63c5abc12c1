package consume

import (
	"errors"
	"strings"
	"sync"
	"testing"
	"time"
)

// A FetchHealth check is OK before any fetch failed, not OK with the error
// while the last fetch failed less than FailureFresh ago, OK again when
// that failure is older (the fetches stopped failing and wait for a
// message) or a fetch brought one; concurrent use is safe.
func TestFetchHealthFollowsTheLastFetch(t *testing.T) {
	var f FetchHealth
	if c := f.Check("kafka"); !c.OK || c.Name != "kafka" {
		t.Fatalf("before any fetch: %+v", c)
	}
	f.Fetched(errors.New("[26] Invalid Session Timeout"))
	c := f.Check("kafka")
	if c.OK || !strings.Contains(c.Detail, "Invalid Session Timeout") {
		t.Fatalf("after a failed fetch: %+v", c)
	}
	f.mu.Lock()
	f.at = f.at.Add(-FailureFresh - time.Second)
	f.mu.Unlock()
	if c := f.Check("kafka"); !c.OK || !strings.Contains(c.Detail, "Invalid Session Timeout") {
		t.Fatalf("a failure that stopped %v ago: %+v", FailureFresh, c)
	}
	f.Fetched(errors.New("broken pipe"))
	if c := f.Check("fetch"); c.OK {
		t.Fatalf("a new failure: %+v", c)
	}
	f.Fetched(nil)
	if c := f.Check("fetch"); !c.OK {
		t.Fatalf("after a fetch that brought a message: %+v", c)
	}

	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 200 {
				if i%2 == 0 {
					f.Fetched(errors.New("x"))
				} else {
					_ = f.Check("kafka")
				}
			}
		}()
	}
	wg.Wait()
}
