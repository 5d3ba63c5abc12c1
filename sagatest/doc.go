// Package sagatest helps you test your own sagas: against a real
// PostgreSQL, with a real engine, in the Postgres-only mode and in Kafka
// mode, without sleeps and without waiting for real backoffs.
//
// # A test
//
// Start an engine on a migrated schema as your service does, start a saga,
// wait for it to end and check its timeline:
//
//	func TestCheckoutRetriesTheCharge(t *testing.T) {
//		ctx := context.Background()
//		engine, err := saga.New(pool, &saga.Config{Schema: schema})
//		require.NoError(t, err)
//		require.NoError(t, engine.Register(checkout))
//		require.NoError(t, engine.Start(ctx))
//		t.Cleanup(func() { engine.Stop(context.Background()) })
//
//		st, err := saga.Start(ctx, engine, checkout, Checkout{OrderID: "o-1"}, nil)
//		require.NoError(t, err)
//		// The provider is down: the charge fails and is retried in an hour.
//		sagatest.Wait(t, engine, st.ID, sagatest.Event("step_failed:charge"), nil)
//		require.NoError(t, sagatest.NewClock(pool, schema, engine).Advance(ctx, time.Hour))
//
//		in := sagatest.WaitEnded(t, engine, st.ID, nil)
//		require.Equal(t, saga.StatusCompleted, in.Status)
//		sagatest.RequireTimeline(t, in, "saga_started", "step_completed:reserve",
//			"step_failed:charge", "step_completed:charge", "saga_completed")
//	}
//
// # Waiting
//
// [Wait] reads a saga until a condition holds: [Ended], [Status], [Step]
// (the saga is at a step), [Event] (its timeline holds an entry) or [Cond].
// [WaitEnded] is Wait with Ended. A wait that does not succeed fails the
// test with the saga's status, its last error and its whole timeline, at
// its deadline ([WaitOpts].Timeout, 30 s by default), or at once when the
// saga has ended without the condition holding. Waits take a [Getter]: any
// *saga.Engine, started or not, so a test can wait on sagas that engines in
// other processes run.
//
// # Timelines
//
// [Timeline] writes a saga's history as one string per entry:
// "step_completed:reserve", "saga_compensated". [RequireTimeline] compares
// it with what the test wants and, when they differ, fails with a line
// diff, the timeline as a Go literal, and each entry's attempt, error and
// detail ([Describe]).
//
// # One step
//
// [RunStep] runs one step's Action or Compensate outside any engine, in a
// transaction that is rolled back at the end of the test, as the engine
// would: the state goes through JSON, a failed step's writes are undone, the
// context ends at the step's Timeout. It takes the [saga.Step] (keep your
// steps in variables: a saga.Definition does not give them back). For a
// remote step it builds the command the step would send.
//
// # Time
//
// sagaflow keeps its deadlines in the database: when a retry is due, when
// a saga counts as stuck, when a remote step's reply is late. A [Clock]
// moves a schema's stored times back ([Clock.Advance]), then wakes the
// engines and relays on the schema and runs the rescuer, so that an hour of
// backoff, a reply timeout of a day, or [saga.Config].UnknownSagaGrace (in
// the Postgres-only mode) passes in milliseconds. It cannot speed up time
// inside a process, nor time carried in a message (in Kafka mode, how long a
// command has been held is in its sagaflow-held-since header): a step
// handler's own context deadline, in-process retries of Kafka consumers,
// and the scheduler's intervals take as long as they say.
//
// # Remote steps
//
// A fake [Participant] serves a command topic for a saga's remote steps in
// Kafka mode: each command type gets an [Answer] ([Reply] with a result,
// [Refuse] with a code, [NoReply], or [AnswerFunc]), which the test can
// change as it goes, and [Participant.Calls] lists what arrived. It is the
// real participant runtime (participant.Participant, an inbox consumer and a
// relay for its replies) with your answers instead of a service's code, so
// the saga's side is tested exactly as in production.
//
// # Crashes
//
// [CrashMatrix] runs your saga with a crash of the engine at each of its
// commit boundaries ([AfterClaim], [AfterHandler], [BeforeCommit],
// [AfterCommit], and in Kafka mode [AfterHold]), one round per crossing of
// each boundary that [CrashOpts].Crossings names (by default the first
// crossing, among the sagas' first steps, and one three quarters of the
// way, among their later steps; [CrashOpts].EveryCrossing tries each),
// restarts it, and fails the
// test unless every saga ends as it does without a crash and every effect
// your [CrashOpts].Effects counts in the database is there exactly as often
// as the saga's timeline says its step, or its compensation, completed: an
// effect written outside run.Tx (with the pool, say) shows up as doubled.
// It needs no build tag, and each round is a subtest named after its
// boundary and crossing:
//
//	sagatest.CrashMatrix(t, pool, transfer, &sagatest.CrashOpts{
//		Config: &saga.Config{Schema: schema},
//		Start: func(ctx context.Context, e *saga.Engine, r sagatest.Round, i int) (uuid.UUID, error) {
//			st, err := saga.Start(ctx, e, transfer, Transfer{ID: fmt.Sprintf("%s-%d", r, i)}, nil)
//			return st.ID, err
//		},
//		Effects: func(ctx context.Context, in *saga.Instance) (map[sagatest.Effect]int, error) {
//			var debits int
//			err := pool.QueryRow(ctx, "SELECT count(*) FROM ledger WHERE saga_id = $1", in.ID).Scan(&debits)
//			return map[sagatest.Effect]int{{Step: "debit"}: debits}, err
//		},
//	})
//
// A crash is in-process: the engine's workers stop at the boundary for
// good, its connections to PostgreSQL are terminated, and a new engine
// starts on the schema. It crashes the engine only: in Kafka mode the
// relay and the participants keep running, and a participant's own
// crashes are not tried.
package sagatest
