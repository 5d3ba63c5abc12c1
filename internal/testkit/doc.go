// Package testkit is the test plumbing shared by this repository's own
// tests; it is for those tests only and promises nothing to anyone else
// (users have the public package sagatest). It builds on [pgtest], which
// finds the test database and gives each test an empty schema. Since it
// imports package saga, saga's own in-package tests cannot use it.
//
// # A schema
//
// [NewDB] gives a test a fresh schema on the shared test database with the
// migrations applied, dropped when the test ends; [Migrate] migrates
// another schema, for tests with several. [DB.Table] qualifies a table name
// with the schema and [DB.Count] reads one number.
//
// [NewEffects] adds an effects table: steps record what they do in their
// own transaction, so "exactly once" is a count of rows.
//
// # Engines
//
// [DB.Config] is the engine configuration tests start from (the schema,
// a 50 ms poll, logs discarded). [NewEngine] builds an engine and registers
// definitions; [Start] starts one and stops it when the test ends, failing
// the test if it does not stop cleanly.
//
//	type order struct{ ID string }
//
//	func TestReserveOnce(t *testing.T) {
//		ctx := context.Background()
//		d := testkit.NewDB(t)
//		fx := testkit.NewEffects(t, d)
//		def := saga.Define("order", saga.Step[order]{Name: "reserve",
//			Action: func(ctx context.Context, run *saga.StepRun, _ *order) error {
//				return fx.Record(ctx, run, "reserve")
//			}})
//		e, _ := testkit.StartEngine(t, d.Pool, d.Config(), def)
//		st, err := saga.Start(ctx, e, def, order{ID: "o-1"}, nil)
//		require.NoError(t, err)
//		testkit.WaitEnded(t, e, st.ID)
//		require.Equal(t, 1, fx.Count(t, st.ID, "reserve"))
//	}
//
// # Participants and handlers
//
// [Serve] runs a participant's consumer on a topic of a test's Kafka
// cluster until the test ends. [CopyReplies] copies a step's reply rows in
// a participant's outbox, as a command delivered twice would have them sent
// twice. A [Gate] holds handlers until the test opens it; a [Buffer] is a
// log or output destination the test reads while others write.
//
// # Waiting
//
// Tests do not sleep to wait for something: [WaitFor] polls a condition
// until a deadline, [Hold] checks that one keeps holding for a while,
// [Recv] waits for a channel, and [WaitEnded] and [WaitStatus] wait for a
// saga. Each fails the test with a message saying what it waited for.
// [Timeline] writes a saga's history one string per entry, for failure
// messages and whole-history assertions, and [Events] counts its entries
// of one type at one step. Handlers that outlive their step on purpose
// count themselves in [Stragglers], which the test waits for.
package testkit
