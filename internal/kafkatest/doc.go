// Package kafkatest is sagaflow's Kafka test harness: an in-process cluster
// that speaks the real Kafka wire protocol, for tests and for running the
// relay without a broker.
//
// There is no Kafka broker in Debian, and tests must not need Docker, so the
// cluster is github.com/twmb/franz-go/pkg/kfake: brokers listening on
// 127.0.0.1 inside the test process, which any Kafka client (kafka-go, kcat)
// talks to as it would to a real cluster.
//
//	func TestSomething(t *testing.T) {
//		kc := kafkatest.New(t, kafkatest.SeedTopics(3, "orders"))
//		w := relay.NewKafkaWriter(kc.Addrs(), nil)
//		defer w.Close()
//		// ... write ...
//		msgs, err := kc.ReadAll(ctx, "orders") // what reached the cluster
//	}
//
// [New] registers Close as a test cleanup; [Start] is the same for code that
// is not a test. Close stops every goroutine the cluster started (the
// project's tests check for leaks with goleak).
//
// Faults are injected with [Cluster.FailProduce] (produce requests answered
// with a retriable per-partition error, for every topic or one, until a
// returned function is called), [Cluster.FailProduceN] (the next n produce
// requests) and [Cluster.Unreachable] (every request on every broker closes
// its connection, as an unreachable cluster looks to a client).
// [Cluster.ProduceRequests] counts the produce requests the cluster has
// received, so a test can wait for a client to have tried.
package kafkatest
