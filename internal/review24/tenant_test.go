package review24

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"sync"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/outbox"
	"github.com/sagaflow/sagaflow/transport/webhook"
)

// tenantReceiver is a receiver behind webhook.Handler with one tenant's
// key; it records the message ids and bodies it was given.
type tenantReceiver struct {
	mu     sync.Mutex
	bodies map[string]string // Idempotency-Key -> body
	dups   int
}

func (tr *tenantReceiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	tr.mu.Lock()
	defer tr.mu.Unlock()
	id := r.Header.Get(webhook.HeaderIdempotencyKey)
	if _, ok := tr.bodies[id]; ok {
		tr.dups++
	}
	tr.bodies[id] = string(b)
	w.WriteHeader(http.StatusNoContent)
}

func (tr *tenantReceiver) snapshot() map[string]string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	out := make(map[string]string, len(tr.bodies))
	for k, v := range tr.bodies {
		out[k] = v
	}
	return out
}

// Two tenants on one PostgreSQL server: two schemas, two running relays,
// two publishers with their own key and URL for the same topic name and
// the same message keys. Each receiver verifies with its own tenant's key
// only, so a message signed or sent across tenants would be refused (and
// parked); each gets exactly its tenant's messages.
func TestTwoTenantsNothingCrosses(t *testing.T) {
	t.Parallel()
	type tenant struct {
		recv *tenantReceiver
		e    *env
		ids  map[string]string // id -> payload
	}
	var tenants []*tenant
	for i, key := range [][]byte{keyA, keyB} {
		tr := &tenantReceiver{bodies: map[string]string{}}
		srv := newHandlerServer(t, webhook.Handler([][]byte{key}, nil, tr))
		e := newEnv(t, webhook.Config{URLs: map[string]string{"orders": srv.URL + "/tenant/" + strconv.Itoa(i)}, Keys: [][]byte{key}}, nil)
		require.NoError(t, e.relay.Start(context.Background()))
		t.Cleanup(func() { require.NoError(t, e.relay.Stop(context.Background())) }) // before the server closes
		tenants = append(tenants, &tenant{recv: tr, e: e, ids: map[string]string{}})
	}
	for round := 0; round < 5; round++ {
		for i, tn := range tenants {
			var msgs []outbox.Message
			for k := 0; k < 4; k++ {
				msgs = append(msgs, outbox.Message{Topic: "orders", Key: "order-" + strconv.Itoa(k), Type: "OrderPlaced",
					Payload: []byte("tenant-" + strconv.Itoa(i) + "/round-" + strconv.Itoa(round) + "/order-" + strconv.Itoa(k))})
			}
			for j, id := range tn.e.insert(t, msgs...) {
				tn.ids[id.String()] = string(msgs[j].Payload)
			}
		}
	}
	for i, tn := range tenants {
		waitFor(t, "tenant "+strconv.Itoa(i)+"'s rows to be published", func() bool {
			return tn.e.db.Count(t, "SELECT count(*) FROM "+tn.e.db.Table("outbox")+" WHERE status <> 'published'") == 0
		})
		require.Equal(t, tn.ids, tn.recv.snapshot(), "tenant %d got exactly its own messages", i)
		tn.recv.mu.Lock()
		require.Zero(t, tn.recv.dups, "without a crash, each row is sent once")
		tn.recv.mu.Unlock()
		for id := range tn.ids {
			require.Equal(t, "published", tn.e.row(t, uuid.MustParse(id)).status)
		}
	}
}
