package pgtest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
)

// StartLogicalServer is [StartServer] for a server with wal_level=logical,
// for tests of logical replication. The setting goes into this server's own
// postgresql.auto.conf before a restart; no other server is touched. The
// caller must call [Server.Stop].
func StartLogicalServer(ctx context.Context) (*Server, error) {
	s, err := StartServer(ctx)
	if err != nil {
		return nil, err
	}
	conf := filepath.Join(s.DataDir(), "postgresql.auto.conf")
	f, err := os.OpenFile(conf, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err == nil {
		_, err = f.WriteString("\nwal_level = logical\nmax_replication_slots = 10\nmax_wal_senders = 10\n")
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err == nil {
		err = s.as.chown(conf)
	}
	if err == nil {
		err = s.Restart(ctx)
	}
	if err != nil {
		_ = s.Stop(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("pgtest: start a server with wal_level=logical: %w", err)
	}
	return s, nil
}
