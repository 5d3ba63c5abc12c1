// Package pgtest is the PostgreSQL test harness of sagaflow.
//
// Tests in this project always talk to a real PostgreSQL server, never a
// mock. [ConnString] finds or starts one, once per test binary, trying in
// order:
//
//  1. the connection string in TEST_DATABASE_URL, else DATABASE_URL, used as is;
//  2. a local server on 127.0.0.1:5432 (user postgres, database postgres,
//     trust authentication) if it answers within about two seconds;
//  3. a throwaway server run as a child process from the PostgreSQL server
//     binaries installed on the machine (see [StartServer]);
//  4. a postgres:15-alpine container started with testcontainers-go, only
//     when a Docker engine answers. testcontainers-go lives in a helper
//     program, internal/pgtest/pgcontainer, a Go module of its own, so that
//     the sagaflow module (and every module that requires it) needs none of
//     Docker's modules: the harness builds the helper with the go command,
//     runs it, reads the connection string it prints, and closes its stdin
//     to have it remove the container, which it also does when the test
//     process dies.
//
// When none is usable the test fails with one message that says what to
// provide and why each step failed.
//
// The environment variable SAGAFLOW_PGTEST forces one step: "url", "local",
// "throwaway" or "container"; unset or "auto" means the order above.
//
// [NewSchema] gives each test a fresh, empty schema and a connection pool,
// and drops the schema when the test ends. [Migrated] (and [PreparedSchema]
// for other preparations) gives a test a migrated schema that holds no rows:
// when a test ends, its schema is emptied and kept for the next test of the
// package if nothing the migrations made was changed, so that most tests
// do not pay for the migrations (creating and dropping the schema and its
// ~90 objects cost the server more than the tests' own work, and left a
// run's worth of dead catalog rows on a server without autovacuum). A test
// package wires the harness in with
//
//	func TestMain(m *testing.M) { pgtest.Main(m) }
//
// which also stops any server or container the process started and checks
// for leaked goroutines once the tests have passed.
//
// The pools of [NewSchema], [Migrated], [PreparedSchema] and [RecentPool]
// check the width of what they send: a test fails when one of its
// statements sends a 64-bit Go integer (int64, time.Duration, uint32, …) to
// a parameter PostgreSQL typed as int4 or int2, whatever the value, because
// past 2^31 that statement fails (a RescueSlack of 36 minutes failed every
// transition that way). After such a statement succeeds, the connection
// describes it once more for its parameters' types, once per distinct
// statement and test process. Go int values are not checked.
//
// Throwaway servers are built from a template data directory that initdb
// creates once per machine and PostgreSQL major version under
// os.TempDir()/sagaflow-pgtest-<uid>; each server gets its own copy of it.
// When the tests run as root the server runs as the "postgres" OS user,
// because PostgreSQL refuses to run as root.
package pgtest
