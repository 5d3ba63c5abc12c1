package limitread_test

import (
	"errors"
	"io"
	"math"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/sagaflow/sagaflow/internal/limitread"
)

func TestRead(t *testing.T) {
	for _, c := range []struct {
		body  string
		limit int64
		over  bool
	}{
		{"", 0, false},
		{"a", 0, true},
		{"abc", 3, false},
		{"abcd", 3, true},
		{"abc", math.MaxInt64, false},
		{"abc", math.MaxInt64 - 1, false},
		{"", -1, true},
		{"a", -1, true},
	} {
		body, over, err := limitread.Read(strings.NewReader(c.body), c.limit)
		if err != nil || over != c.over {
			t.Errorf("%q at %d: over %v, err %v; want over %v", c.body, c.limit, over, err, c.over)
		}
		if !c.over && string(body) != c.body {
			t.Errorf("%q at %d: read %q", c.body, c.limit, body)
		}
		if c.over && int64(len(body)) > max(c.limit, 0)+1 {
			t.Errorf("%q at %d: read %d bytes, more than one past the limit", c.body, c.limit, len(body))
		}
	}
	// A body far past the limit is not read to its end.
	r := &countingReader{r: strings.NewReader(strings.Repeat("x", 1<<20))}
	if _, over, _ := limitread.Read(r, 10); !over || r.n > 11 {
		t.Errorf("read %d bytes of a 1 MiB body at a limit of 10 (over %v)", r.n, over)
	}
	boom := errors.New("boom")
	if _, _, err := limitread.Read(iotest.ErrReader(boom), 10); !errors.Is(err, boom) {
		t.Errorf("a failing reader: %v", err)
	}
}

type countingReader struct {
	r io.Reader
	n int
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += n
	return n, err
}
