package store

import (
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
)

// FuzzDecodeCursor: a listing cursor comes from a user (the CLI's --cursor);
// anything that is not a cursor is ErrMalformedCursor, never a panic, and a
// real cursor round-trips.
func FuzzDecodeCursor(f *testing.F) {
	f.Add(encodeCursor(time.Date(2026, 11, 21, 6, 0, 0, 123456000, time.UTC), uuid.New()))
	f.Add("not-a-cursor")
	f.Add("")
	f.Fuzz(func(t *testing.T, c string) {
		at, id, err := decodeCursor(c)
		if err != nil {
			if !errors.Is(err, ErrMalformedCursor) {
				t.Fatalf("want ErrMalformedCursor, got %v", err)
			}
			return
		}
		if again := encodeCursor(at, id); again != c {
			// Several encodings may decode alike; the decoded value must
			// at least survive a round trip.
			at2, id2, err := decodeCursor(again)
			if err != nil || !at2.Equal(at) || id2 != id {
				t.Fatalf("cursor %q does not round-trip: %v %v %v", c, at2, id2, err)
			}
		}
	})
}
