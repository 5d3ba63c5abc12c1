package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/sagaflow/sagaflow/examples/checkout/shop"
	"github.com/sagaflow/sagaflow/internal/kafkatest"
	"github.com/sagaflow/sagaflow/internal/pgtest"
)

// The test supplies what a user supplies: a PostgreSQL (the harness's) and
// Kafka brokers (an in-process cluster).

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestProgramRunsOnTheGivenDatabaseAndBrokers runs the program as a user
// would, with -dsn and -brokers, and checks that every order ends as
// expected and that the schemas it created are gone afterwards.
func TestProgramRunsOnTheGivenDatabaseAndBrokers(t *testing.T) {
	dsn := pgtest.ConnString(t)
	pool, schema := pgtest.NewSchema(t) // names the run's schemas, unique on the server
	kc := kafkatest.New(t, kafkatest.SeedTopics(3, shop.Topics...))

	var out, errOut bytes.Buffer
	status := run(context.Background(),
		[]string{"-dsn", dsn, "-brokers", strings.Join(kc.Addrs(), ","), "-schema-prefix", schema},
		func(string) string { return "" }, &out, &errOut)
	t.Log(out.String())
	require.Equal(t, 0, status, "stderr: %s", errOut.String())
	require.Contains(t, out.String(), "9 orders in ")
	require.Contains(t, out.String(), "every order ended as expected")
	require.Contains(t, out.String(), "schemas: "+schema+"_")

	// The successful order is one trace across the four services: the
	// request at its root, and each participant's work under the step
	// that called it, with the reply under the participant's handler.
	tree := out.String()[strings.Index(out.String(), "as one trace:"):]
	require.Contains(t, tree, "spans across inventory, orders, payments, shipping")
	lines := strings.Split(tree, "\n")
	require.True(t, strings.HasPrefix(lines[2], "└─ POST /orders"), "the request is the root: %q", lines[2])
	depth := func(name string) int {
		t.Helper()
		for _, l := range lines {
			if i := strings.Index(l, "─ "+name+" "); i >= 0 {
				return utf8.RuneCountInString(l[:i])
			}
		}
		t.Fatalf("no span %q in the tree:\n%s", name, tree)
		return 0
	}
	for _, call := range []struct{ step, service string }{
		{"reserve", "inventory.reserve"}, {"charge", "payments.charge"}, {"ship", "shipping.create"},
	} {
		step := depth("step checkout/" + call.step)
		require.Greater(t, depth("process "+call.service), step, "the %s service's work is under the step that called it", call.service)
		require.Greater(t, depth("handle "+call.service), depth("process "+call.service))
		require.Greater(t, depth("reply checkout/"+call.step), depth("handle "+call.service), "the reply continues the handler's span")
	}

	var left int
	require.NoError(t, pool.QueryRow(context.Background(),
		"SELECT count(*) FROM pg_namespace WHERE starts_with(nspname, $1)", schema+"_").Scan(&left))
	require.Zero(t, left, "the run's schemas are dropped")
}

// TestProgramNeedsADatabaseAndBrokers checks that the program says what it
// lacks, and that KAFKA_BROKERS and DATABASE_URL stand for the flags.
func TestProgramNeedsADatabaseAndBrokers(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
	}{
		{name: "nothing"},
		{name: "no brokers", args: []string{"-dsn", "postgres://127.0.0.1:1/x"}},
		{name: "no database", env: map[string]string{"KAFKA_BROKERS": "127.0.0.1:1"}},
		{name: "a bad flag", args: []string{"-dns", "postgres://127.0.0.1:1/x"}, env: map[string]string{"KAFKA_BROKERS": "127.0.0.1:1"}},
		{name: "no escalation", args: []string{"-dsn", "postgres://127.0.0.1:1/x", "-escalation", "0s"}, env: map[string]string{"KAFKA_BROKERS": "127.0.0.1:1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out, errOut bytes.Buffer
			status := run(context.Background(), tc.args, func(k string) string { return tc.env[k] }, &out, &errOut)
			require.Equal(t, 2, status)
			require.Empty(t, out.String())
			switch tc.name {
			case "no escalation":
				require.Contains(t, errOut.String(), "-escalation must be positive")
			case "a bad flag":
				require.Contains(t, errOut.String(), "flag provided but not defined: -dns")
			default:
				require.Contains(t, errOut.String(), "give a PostgreSQL (-dsn or DATABASE_URL) and Kafka brokers (-brokers or KAFKA_BROKERS)")
			}
		})
	}
}
