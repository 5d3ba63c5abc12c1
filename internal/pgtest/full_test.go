package pgtest

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

// whileServerFull runs its function again only while the server says it
// has no connection slot left (53300, also when wrapped as a connect error
// is), and gives up when its context ends.
func TestWhileServerFullRetriesOnlyAFullServer(t *testing.T) {
	full := fmt.Errorf("connect: %w", &pgconn.PgError{Code: "53300", Message: "sorry, too many clients already"})
	calls := 0
	err := whileServerFull(context.Background(), func() error {
		calls++
		if calls < 3 {
			return full
		}
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, 3, calls)

	other := &pgconn.PgError{Code: "42P06", Message: "schema already exists"}
	calls = 0
	err = whileServerFull(context.Background(), func() error { calls++; return other })
	require.ErrorIs(t, err, other)
	require.Equal(t, 1, calls, "another error is not retried")

	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	calls = 0
	err = whileServerFull(ctx, func() error { calls++; return full })
	var pgErr *pgconn.PgError
	require.True(t, errors.As(err, &pgErr))
	require.Equal(t, "53300", pgErr.Code)
	require.GreaterOrEqual(t, calls, 2)
	require.LessOrEqual(t, calls, 4, "every 200 ms until the context ends")
}
