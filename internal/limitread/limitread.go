// Package limitread reads a body up to a limit, telling a body at the
// limit from a larger one without reading more than one byte past it.
package limitread

import (
	"io"
	"math"
)

// Read reads r to its end or to one byte past limit, whichever comes
// first. over reports a body longer than limit; body is then cut and
// must not be used. A limit of int64's largest reads everything (one past
// it would wrap negative, and a LimitReader of a negative N reads
// nothing); a negative limit takes every body, even an empty one, as over.
func Read(r io.Reader, limit int64) (body []byte, over bool, err error) {
	body, err = io.ReadAll(io.LimitReader(r, min(max(limit, 0), math.MaxInt64-1)+1))
	if err != nil {
		return nil, false, err
	}
	return body, int64(len(body)) > limit, nil
}
